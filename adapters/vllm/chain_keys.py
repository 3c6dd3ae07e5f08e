"""Block keys that mean the same in every process.

vLLM's block hashes (`request.block_hashes`) start their chain at
`NONE_HASH`, which vLLM 0.32 derives from `PYTHONHASHSEED` when it is set
and from a random per-process seed for its xxhash algorithms, and which
pickles its input (a pickle protocol can change with Python). A tier that
outlives the process (block files) needs keys that do not, so kvledger chains
its own, at vLLM's blocks and with vLLM's extra keys:

    key[i] = H(key[i-1] ‖ the block's token ids ‖ its extra keys)
    with H(root) in place of key[-1] for the first block

where H is 16 bytes of one of three hashes (`lower_tiers.block_keys` picks):
BLAKE2b keyed with a subkey of the tiers' secrets (`KEYED`: key names tell
nothing about prompts to whoever lacks the secret), plain BLAKE2b where vLLM's
own prefix-cache hash is SHA-256, its default (`CRYPTOGRAPHIC`: no one can
search for two prompts with one key), or xxh3_128 where vLLM's is xxhash
(`FAST`: 0.2 us a block against 1.0-1.2).

Token ids are little-endian int32, or int64 when one of the block's ids does
not fit. Extra keys (LoRA, multimodal items, the cache salt, prompt-embeds
digests) come from vLLM's own `generate_block_hash_extra_keys`, called with
the block boundaries and multimodal index its block hasher uses, and only for
blocks that can have any; they are encoded by `repr`, after checking
that they hold only values whose `repr` is the same in every process. A block
with neither int64 ids nor extra keys is hashed as the chain key and its ids
alone; any other block ends with its extra keys' length and its id width.
With every chain key 16 bytes (the root's too, hence its hash), a block's
bytes can be read back one way only, for any root, at a given block size.

`root` should name whatever else the cached KV depends on (the model, its
dtype, the block size): two prefixes get the same keys only when they and
their roots are equal (or H collides).
"""

from __future__ import annotations

import hashlib
import os
import struct
from collections.abc import Callable, Sequence
from typing import TYPE_CHECKING

from vllm.multimodal.utils import get_mm_features_in_window
from vllm.v1.core.kv_cache_utils import generate_block_hash_extra_keys
from xxhash import xxh3_128_digest

if TYPE_CHECKING:
    from vllm.v1.request import Request

KEY_BYTES = 16
FAST, CRYPTOGRAPHIC, KEYED = "xxh3_128", "blake2b_128", "blake2b_128_keyed"

# The types whose `repr` is the same in every process and which vLLM 0.32 puts in extra keys.
_STABLE_REPR = frozenset((str, int, bytes, type(None)))


def generation_root(root: bytes, generation: int, salt: bytes = b"") -> bytes:
    """The root of key generation `generation`: `root` itself for the first
    (keys written before any reset stay findable after a restart), then a root
    no earlier generation can share. A cache reset begins a new generation.

    `salt` (random, by default) makes the generation this process's alone: two
    replicas each reset once would otherwise share generation 1 whatever
    weights each loaded, and serve each other's KV."""
    if generation < 0:
        raise ValueError(f"generation must be >= 0, not {generation}")
    if generation == 0:
        return root
    return root + b"generation" + generation.to_bytes(8, "little") + salt


def _hasher(block_keys: str, secret: bytes | None) -> Callable[[bytes], bytes]:
    if block_keys == FAST:
        return xxh3_128_digest
    if block_keys == CRYPTOGRAPHIC:
        return lambda data: hashlib.blake2b(data, digest_size=KEY_BYTES).digest()
    if block_keys == KEYED and secret is not None:
        return lambda data: hashlib.blake2b(data, digest_size=KEY_BYTES, key=secret).digest()
    raise ValueError(f"block keys {block_keys!r} with{'out' if secret is None else ''} a secret")


class ChainKeys:
    """Keys for each request's full blocks, as many as `request.block_hashes`.

    Computed as the request grows (a new block costs one hash) and kept per
    request id until `forget`. `keys` returns the request's own list: read it,
    never change it.
    """

    def __init__(self, root: bytes, hash_block_size: int, block_keys: str = FAST,
                 secret: bytes | None = None) -> None:
        if not isinstance(root, bytes):
            raise TypeError(f"root must be bytes, not {type(root).__name__}")
        if hash_block_size < 1:
            raise ValueError(f"hash_block_size must be positive, not {hash_block_size}")
        self.root = root
        self._hash = _hasher(block_keys, secret)
        self._root_key = self._hash(root)
        self.hash_block_size = hash_block_size
        # One compiled struct per width: measured faster than array('i') or numpy
        # for a block's ids (bench/chain_keys.py).
        self._narrow = struct.Struct(f"<{hash_block_size}i").pack
        self._wide = struct.Struct(f"<{hash_block_size}q").pack
        self._chains: dict[str, list[bytes]] = {}
        self._bases: dict[str, list[bytes]] = {}

    def keys(self, request: Request) -> Sequence[bytes]:
        chain = self._chains.get(request.request_id)
        if chain is None:
            chain = self._chains[request.request_id] = []
            self._bases[request.request_id] = []
        basis = self._bases[request.request_id]  # vLLM's hash of each keyed block, as it was then
        hashes = request.block_hashes
        wanted = len(hashes)
        done = len(chain)
        if done and (wanted < done or hashes[done - 1] != basis[done - 1]):
            # A streaming session's next input replaced its last sampled token, and vLLM
            # hashed that token's block again: key it again from there.
            done = min(wanted, done)
            while done and hashes[done - 1] != basis[done - 1]:
                done -= 1
            del chain[done:], basis[done:]
        if wanted > done:
            self._extend(chain, request, done, wanted)
            basis.extend(hashes[done:wanted])
        return chain

    def forget(self, request_id: str) -> None:
        self._chains.pop(request_id, None)
        self._bases.pop(request_id, None)

    def __len__(self) -> int:
        """Requests with keys held."""
        return len(self._chains)

    def _extend(self, chain: list[bytes], request: Request, done: int, wanted: int) -> None:
        size = self.hash_block_size
        start = done * size
        tokens = request.all_token_ids[start:wanted * size]
        assert len(tokens) == (wanted - done) * size, (
            f"request {request.request_id}: {wanted} block hashes of {size} tokens, "
            f"{request.num_tokens} tokens")
        prev = chain[-1] if chain else self._root_key
        digest = self._hash
        # vLLM's extra keys for the blocks up to `extra_end`, the bare ids after it.
        extra_end = _extra_keys_end(request, start, len(tokens), size)
        if extra_end:
            mm_index = _first_mm_index(request, start, size)
            lora = request.lora_request
            adapter = adapter_digest(lora.lora_path) if lora is not None else None
            for offset in range(0, extra_end, size):
                extra_keys, mm_index = generate_block_hash_extra_keys(
                    request, start + offset, start + offset + size, mm_index)
                if adapter is not None:
                    extra_keys = _lora_by_content(extra_keys, adapter)
                prev = digest(prev + self._encoded(tokens[offset:offset + size], extra_keys))
                chain.append(prev)
        narrow = self._narrow
        for offset in range(extra_end, len(tokens), size):
            block = tokens[offset:offset + size]
            try:
                prev = digest(prev + narrow(*block))
            except struct.error:
                prev = digest(prev + self._encoded(block, None))
            chain.append(prev)

    def _encoded(self, block: list[int], extra_keys: tuple | None) -> bytes:
        """A block's ids and extra keys, unless it has neither wide ids nor extra keys."""
        try:
            ids, width = self._narrow(*block), b"\x04"
        except struct.error:
            try:
                ids, width = self._wide(*block), b"\x08"
            except struct.error:
                raise ValueError(f"a token id outside int64 in {block}") from None
        if extra_keys is None:
            if width == b"\x04":
                return ids
            extra = b""
        else:
            _check_stable(extra_keys)
            extra = repr(extra_keys).encode()
        return ids + extra + len(extra).to_bytes(4, "little") + width


_ADAPTER_FILES = (".safetensors", ".bin", ".pt", ".json")
_adapter_digests: dict[tuple, str] = {}


def adapter_digest(path: str) -> str | None:
    """A digest of a LoRA adapter's files (weights and config), for keys that
    follow what it computes, not where it lives: an adapter replaced under the
    same path keys anew, one copied elsewhere keys the same. Cached by the files'
    sizes and times, so a request costs a few stats. None where `path` is not a
    local directory (a hub name): then vLLM's name and path key it, as before."""
    try:
        entries = sorted((entry.name, entry.stat().st_size, entry.stat().st_mtime_ns)
                         for entry in os.scandir(path)
                         if entry.is_file() and entry.name.endswith(_ADAPTER_FILES))
    except OSError:
        return None
    if not entries:
        return None
    signature = (os.path.realpath(path), tuple(entries))
    digest = _adapter_digests.get(signature)
    if digest is None:
        hasher = hashlib.blake2b(digest_size=16)
        for name, _size, _mtime in entries:
            hasher.update(name.encode() + b"\0")
            with open(os.path.join(path, name), "rb") as file:
                hasher.update(hashlib.file_digest(file, "blake2b").digest())
        digest = _adapter_digests[signature] = hasher.hexdigest()
    return digest


def _lora_by_content(extra_keys: tuple, adapter: str) -> tuple:
    """vLLM's ("lora", name, path) extra key, with the path replaced by the adapter's digest."""
    return tuple(("lora", key[1], "content:" + adapter) if key and key[0] == "lora" else key for key in extra_keys)


def _extra_keys_end(request: Request, start: int, count: int, size: int) -> int:
    """How many of the `count` tokens from `start` lie in blocks vLLM may give
    extra keys: all of them with a LoRA, images or prompt embeddings, the first
    block with a cache salt (`generate_block_hash_extra_keys`), else none.
    Most requests have none, and asking vLLM costs about 0.5 µs a block."""
    if request.lora_request or request.mm_features or request.prompt_embeds is not None:
        return count
    if request.cache_salt and start == 0:
        return min(size, count)
    return 0


def _first_mm_index(request: Request, start: int, size: int) -> int:
    """The multimodal index vLLM's block hasher starts from at token `start`
    (`get_request_block_hasher`)."""
    features = request.mm_features
    if start > 0 and features:
        last = features[-1].mm_position
        if last.offset + last.length > start:
            return get_mm_features_in_window(features, start, start + size)[0]
    return 0


def _check_stable(extra_keys: tuple) -> None:
    """vLLM 0.32 gives a tuple of flat tuples (a tag, then strs, ints or bytes)."""
    for key in extra_keys:
        if type(key) is not tuple:
            raise TypeError(f"vLLM gave an extra key that is not a tuple: {key!r}")
        for item in key:
            if type(item) not in _STABLE_REPR:  # exact types: a subclass may define its own repr
                raise TypeError(f"vLLM gave an extra key of type {type(item).__name__}, whose repr "
                                f"may differ between processes: {key!r}")
