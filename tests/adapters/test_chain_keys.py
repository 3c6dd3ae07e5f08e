"""kvledger's own block keys: stable across processes, chained like vLLM's block hashes."""

from __future__ import annotations

import json
import os
from pathlib import Path

import pytest

pytest.importorskip("vllm", reason="needs the vllm package")  # before the imports that need it
import torch
from vllm.lora.request import LoRARequest
from vllm.multimodal.inputs import MultiModalFeatureSpec, PlaceholderRange
from vllm.sampling_params import SamplingParams
from vllm.utils.hashing import sha256
from vllm.v1.core import kv_cache_utils
from vllm.v1.request import Request

from kvledger.adapters.vllm import chain_keys as ck
from kvledger.adapters.vllm.chain_keys import ChainKeys
from tests.support.zygotes import run_under_another_seed

pytestmark = pytest.mark.vllm  # imports vLLM's types: not in the fast subset, which runs without vLLM

ROOT = Path(__file__).resolve().parents[2]
H = 16
ROOT_KEY = b"model-a/bf16/16"


def hasher(hash_block_size: int = H, hash_fn=sha256):
    kv_cache_utils.init_none_hash(hash_fn)
    return kv_cache_utils.get_request_block_hasher(hash_block_size, hash_fn)


def request(tokens, rid: str = "r", *, hash_block_size: int = H, **kwargs) -> Request:
    """A request as vLLM's engine core makes it: its block hashes computed as it grows."""
    return Request(rid, list(tokens), SamplingParams(max_tokens=4096), None,
                   block_hasher=hasher(hash_block_size), **kwargs)


def keys_of(tokens, *, root: bytes = ROOT_KEY, **kwargs) -> list[bytes]:
    return list(ChainKeys(root, H).keys(request(tokens, **kwargs)))


def image(identifier: str, offset: int, length: int) -> MultiModalFeatureSpec:
    return MultiModalFeatureSpec(data=None, modality="image", identifier=identifier,
                                 mm_position=PlaceholderRange(offset=offset, length=length))


TOKENS = list(range(1000, 1100))  # 6 full blocks and 4 tokens


# Stable across processes.

def _keys_and_hashes() -> dict:
    """This process's keys for four kinds of request, and vLLM's own block hashes of them
    (xxhash, whose seed is PYTHONHASHSEED's, or random without one)."""
    from vllm.utils.hashing import xxhash

    saved = {name: getattr(kv_cache_utils, name) for name in ("NONE_HASH", "_NONE_HASH_SEED")
             if hasattr(kv_cache_utils, name)}  # unset until a first `init_none_hash`
    try:
        block_hasher = hasher(16, xxhash)
        kinds = {"plain": {}, "salted": {"cache_salt": "s"}, "lora": {"lora_request": LoRARequest("l", 1, "/p")},
                 "images": {"mm_features": [image("img-0", 20, 30), image("img-1", 50, 10)]}}
        keys, hashes = {}, {}
        for kind, extra in kinds.items():
            r = Request(kind, list(range(100)), SamplingParams(max_tokens=8), None, block_hasher=block_hasher,
                        **extra)
            keys[kind] = [k.hex() for k in ChainKeys(b"root", 16).keys(r)]
            hashes[kind] = [h.hex() for h in r.block_hashes]
    finally:
        for name, value in saved.items():
            setattr(kv_cache_utils, name, value)
    return {"keys": keys, "vllm": hashes}




@pytest.mark.slow
def test_keys_are_the_same_in_processes_with_different_hash_seeds() -> None:
    """This process against one forked from a zygote under another PYTHONHASHSEED
    (the one the on-vLLM tests use, so no second import of vLLM)."""
    there = json.loads(run_under_another_seed("tests.adapters.test_chain_keys"))
    here = _keys_and_hashes()
    assert here["keys"] == there["keys"]
    assert all(len(keys) == 6 for keys in here["keys"].values())
    assert len({tuple(keys) for keys in here["keys"].values()}) == 4  # the extra keys count
    # vLLM's own hashes (xxhash, seeded by PYTHONHASHSEED) are not: the reason for these keys.
    assert here["vllm"]["plain"] != there["vllm"]["plain"]


# The chain.

def test_keys_grown_block_by_block_equal_keys_computed_at_once() -> None:
    growing = request(TOKENS[:5])
    chain_keys = ChainKeys(ROOT_KEY, H)
    seen = []
    for token in TOKENS[5:]:
        growing.append_output_token_ids(token)
        keys = chain_keys.keys(growing)
        assert len(keys) == len(growing.block_hashes) == growing.num_tokens // H
        seen.append(list(keys))
    final = keys_of(TOKENS)
    assert seen[-1] == final
    assert all(keys == final[:len(keys)] for keys in seen)


def test_a_different_token_anywhere_changes_the_key_of_its_block_and_of_every_later_one() -> None:
    base = keys_of(TOKENS)
    assert len(set(base)) == len(base) and {len(k) for k in base} == {ck.KEY_BYTES}
    for position in (0, 15, 16, 40, 95):
        changed = list(TOKENS)
        changed[position] += 1
        keys = keys_of(changed)
        block = position // H
        assert keys[:block] == base[:block]
        assert all(a != b for a, b in zip(keys[block:], base[block:])), position


def test_requests_sharing_a_prefix_share_the_keys_of_its_full_blocks() -> None:
    shared = TOKENS[:56]  # 3 full blocks and half of the 4th
    a = keys_of(shared + [1] * 40, rid="a")
    b = keys_of(shared + [2] * 40, rid="b")
    assert a[:3] == b[:3]
    assert all(x != y for x, y in zip(a[3:], b[3:]))


def test_each_key_generation_after_the_first_changes_every_key() -> None:
    # The first keeps the root: blocks written before any reset are found after a restart.
    assert ck.generation_root(ROOT_KEY, 0) == ROOT_KEY
    generations = [keys_of(TOKENS, root=ck.generation_root(ROOT_KEY, g)) for g in range(4)]
    assert generations[0] == keys_of(TOKENS)
    for i, keys in enumerate(generations):
        for other in generations[i + 1:]:
            assert all(x != y for x, y in zip(keys, other))
    with pytest.raises(ValueError, match="generation must be >= 0"):
        ck.generation_root(ROOT_KEY, -1)


def test_the_root_cache_salt_and_lora_each_change_every_key() -> None:
    base = keys_of(TOKENS)
    variants = {
        "root": keys_of(TOKENS, root=b"model-b/bf16/16"),
        "salt": keys_of(TOKENS, cache_salt="tenant-1"),
        "other salt": keys_of(TOKENS, cache_salt="tenant-2"),
        "lora": keys_of(TOKENS, lora_request=LoRARequest("sql", 1, "/adapters/sql")),
        "other lora": keys_of(TOKENS, lora_request=LoRARequest("chat", 2, "/adapters/chat")),
        "lora moved": keys_of(TOKENS, lora_request=LoRARequest("sql", 1, "/adapters/sql-v2")),
    }
    every = [base, *variants.values()]
    for i, keys in enumerate(every):
        assert len(keys) == len(base)
        for other in every[i + 1:]:
            assert all(x != y for x, y in zip(keys, other))


def test_an_image_changes_the_keys_from_its_first_block_on() -> None:
    base = keys_of(TOKENS, mm_features=[image("cat", 35, 20)])
    other = keys_of(TOKENS, mm_features=[image("dog", 35, 20)])
    moved = keys_of(TOKENS, mm_features=[image("cat", 36, 20)])
    plain = keys_of(TOKENS)
    assert base[:2] == other[:2] == moved[:2] == plain[:2]  # tokens 0-31: before the image
    for keys in (other, moved, plain):
        assert all(x != y for x, y in zip(base[2:], keys[2:]))


def test_prompt_embeds_change_the_keys_of_their_blocks() -> None:
    embeds = torch.arange(48 * 4, dtype=torch.float32).reshape(48, 4)
    changed = embeds.clone()
    changed[20, 0] += 1

    def keys(e):
        r = Request("e", None, SamplingParams(max_tokens=8), None, prompt_embeds=e, block_hasher=hasher())
        return list(ChainKeys(ROOT_KEY, H).keys(r))

    a, b = keys(embeds), keys(changed)
    assert len(a) == 3 and a[0] == b[0]
    assert a[1] != b[1] and a[2] != b[2]


def test_ids_past_int32_are_hashed_as_int64() -> None:
    big = list(TOKENS)
    big[20] = 2**31
    keys = keys_of(big)
    assert len(keys) == 6 and keys[0] == keys_of(TOKENS)[0]
    wrapped = list(big)
    wrapped[20] = -(2**31)  # the same low 32 bits
    assert keys_of(wrapped)[1] != keys[1]
    # Incremental computation takes the same path.
    growing = request(big[:30])
    chain_keys = ChainKeys(ROOT_KEY, H)
    for token in big[30:]:
        growing.append_output_token_ids(token)
        chain_keys.keys(growing)
    assert list(chain_keys.keys(growing)) == keys


# The same blocks and extra keys as vLLM's block hasher.

def test_the_count_follows_the_block_hashes_at_any_hash_block_size() -> None:
    for hash_block_size in (1, 4, 16):
        # Group blocks of 32 and 48 tokens hash every 16 (their GCD), and finer with prefix_match_unit.
        r = request([], hash_block_size=hash_block_size)
        chain_keys = ChainKeys(ROOT_KEY, hash_block_size)
        assert len(chain_keys.keys(r)) == 0
        for token in range(100):
            r.append_output_token_ids(token)
            assert len(chain_keys.keys(r)) == len(r.block_hashes) == r.num_tokens // hash_block_size
    unhashed = Request("u", TOKENS, SamplingParams(max_tokens=8), None)  # made without a block hasher
    assert len(ChainKeys(ROOT_KEY, H).keys(unhashed)) == 0


class ExtraKeysSpy:
    """Records what `generate_block_hash_extra_keys` returns for each block, per caller."""

    def __init__(self, monkeypatch: pytest.MonkeyPatch) -> None:
        self.calls: dict[str, dict[tuple[int, int], object]] = {"vllm": {}, "kvledger": {}}
        real = kv_cache_utils.generate_block_hash_extra_keys
        for caller, module in (("vllm", kv_cache_utils), ("kvledger", ck)):
            def spy(request, start, end, mm_index, _calls=self.calls[caller]):
                result = real(request, start, end, mm_index)
                _calls[(start, end)] = result[0]
                return result

            monkeypatch.setattr(module, "generate_block_hash_extra_keys", spy)


def test_extra_keys_are_vllms_for_every_block_as_the_request_grows(monkeypatch) -> None:
    spy = ExtraKeysSpy(monkeypatch)
    # Images that start, end and abut mid-block, some beyond the prompt (a streaming input's).
    features = [image("a", 3, 10), image("b", 13, 3), image("c", 20, 40), image("d", 70, 2),
                image("e", 72, 17), image("f", 95, 1)]
    growing = request(TOKENS[:18], mm_features=features, cache_salt="s",
                      lora_request=LoRARequest("l", 1, "/l"))
    chain_keys = ChainKeys(ROOT_KEY, H)
    for token in TOKENS[18:]:
        growing.append_output_token_ids(token)
        chain_keys.keys(growing)
    assert spy.calls["kvledger"] == spy.calls["vllm"]
    assert len(spy.calls["vllm"]) == 6
    images = {block: [k for k in keys if k[0] == "mm"] for block, keys in spy.calls["vllm"].items()}
    assert images[(0, 16)] == [("mm", "a", 3), ("mm", "b", 13)]
    assert images[(32, 48)] == [("mm", "c", -12)]  # offsets are relative to the block: negative inside an image
    assert images[(64, 80)] == [("mm", "d", 6), ("mm", "e", 8)]
    assert list(chain_keys.keys(growing)) == keys_of(TOKENS, mm_features=features, cache_salt="s",
                                                     lora_request=LoRARequest("l", 1, "/l"))


def test_extra_keys_are_asked_only_for_blocks_that_can_have_some(monkeypatch) -> None:
    spy = ExtraKeysSpy(monkeypatch)
    keys_of(TOKENS)
    assert len(spy.calls["vllm"]) == 6 and spy.calls["kvledger"] == {}
    salted = keys_of(TOKENS, rid="s", cache_salt="tenant")  # a salt keys the first block only
    assert spy.calls["kvledger"] == {(0, 16): (("cache_salt", "tenant"),)}
    assert all(spy.calls["vllm"][(start, start + H)] is None for start in range(16, 96, 16))
    assert salted[0] != keys_of(TOKENS)[0]


def test_an_extra_key_whose_repr_could_change_between_processes_is_refused(monkeypatch) -> None:
    monkeypatch.setattr(ck, "generate_block_hash_extra_keys", lambda *args: ((("mm", object(), 0),), 0))
    with pytest.raises(TypeError, match="extra key of type object"):
        keys_of(TOKENS, cache_salt="s")


# Per request.

def test_keys_are_kept_per_request_until_forgotten() -> None:
    chain_keys = ChainKeys(ROOT_KEY, H)
    a, b = request(TOKENS, "a"), request(TOKENS[:40], "b")
    assert list(chain_keys.keys(a)) == keys_of(TOKENS)
    assert len(chain_keys.keys(b)) == 2 and len(chain_keys) == 2
    assert chain_keys.keys(a) is chain_keys.keys(a)  # no work when nothing grew
    chain_keys.forget("a")
    chain_keys.forget("never-seen")
    assert len(chain_keys) == 1
    assert list(chain_keys.keys(a)) == keys_of(TOKENS)


def test_bad_arguments_are_refused() -> None:
    with pytest.raises(TypeError, match="root must be bytes"):
        ChainKeys("root", H)  # type: ignore[arg-type]
    with pytest.raises(ValueError, match="hash_block_size"):
        ChainKeys(b"root", 0)


def test_a_streaming_session_whose_last_token_is_replaced_is_keyed_again_from_that_block() -> None:
    """vLLM's `_update_request_as_session`: the last sampled token goes, the hashes from its
    block on are dropped and computed again with the next input's tokens."""
    session = request(TOKENS[:48])  # three full blocks, the third ending with the sampled token
    chain_keys = ChainKeys(ROOT_KEY, H)
    assert list(chain_keys.keys(session)) == keys_of(TOKENS[:48])
    kept = session.num_tokens - 1
    del session._all_token_ids[kept:]
    del session.block_hashes[kept // H:]
    assert len(chain_keys.keys(session)) == 2  # shorter than the keys before: no stale third key
    session._all_token_ids.extend([7, 8, 9])
    session.update_block_hashes()
    new_tokens = TOKENS[:47] + [7, 8, 9]
    assert list(chain_keys.keys(session)) == keys_of(new_tokens)
    assert keys_of(new_tokens)[2] != keys_of(TOKENS[:48])[2]


def test_a_private_generation_is_salted_and_a_counted_one_is_not() -> None:
    """Two replicas reset once each: counted, they share generation 1; private, never."""
    assert ck.generation_root(ROOT_KEY, 1) == ck.generation_root(ROOT_KEY, 1, b"")
    a = keys_of(TOKENS, root=ck.generation_root(ROOT_KEY, 1, os.urandom(16)))
    b = keys_of(TOKENS, root=ck.generation_root(ROOT_KEY, 1, os.urandom(16)))
    assert all(x != y for x, y in zip(a, b))


def test_keyed_and_cryptographic_chains_differ_from_the_fast_one_and_by_secret() -> None:
    req = request(TOKENS)
    fast = list(ChainKeys(ROOT_KEY, H).keys(req))
    strong = list(ChainKeys(ROOT_KEY, H, ck.CRYPTOGRAPHIC).keys(request(TOKENS)))
    keyed = list(ChainKeys(ROOT_KEY, H, ck.KEYED, b"k" * 32).keys(request(TOKENS)))
    other = list(ChainKeys(ROOT_KEY, H, ck.KEYED, b"j" * 32).keys(request(TOKENS)))
    assert len({len(fast), len(strong), len(keyed), len(other)}) == 1 and len(fast) == 6
    for one, two in ((fast, strong), (fast, keyed), (strong, keyed), (keyed, other)):
        assert all(x != y for x, y in zip(one, two))
    # Whoever lacks the secret cannot confirm a guessed prompt from a key name.
    assert list(ChainKeys(ROOT_KEY, H, ck.KEYED, b"k" * 32).keys(request(TOKENS, rid="again"))) == keyed
    with pytest.raises(ValueError, match="without a secret"):
        ChainKeys(ROOT_KEY, H, ck.KEYED)


def test_a_lora_adapter_is_keyed_by_its_files_not_its_path(tmp_path) -> None:
    one, two = tmp_path / "one", tmp_path / "two"
    for folder in (one, two):
        folder.mkdir()
        (folder / "adapter_config.json").write_text('{"r": 8}')
        (folder / "adapter_model.safetensors").write_bytes(b"weights-v1")
    at_one = keys_of(TOKENS, lora_request=LoRARequest("sql", 1, str(one)))
    # The same files under another path: the same keys.
    assert keys_of(TOKENS, lora_request=LoRARequest("sql", 1, str(two))) == at_one
    # New weights under the same path: new keys (vLLM keys by name and path alone).
    (one / "adapter_model.safetensors").write_bytes(b"weights-v2")
    os.utime(one / "adapter_model.safetensors", ns=(1, 1))
    assert all(x != y for x, y in zip(keys_of(TOKENS, lora_request=LoRARequest("sql", 1, str(one))), at_one))
    # Not a local directory (a hub name): keyed by name and path, as vLLM does.
    assert ck.adapter_digest(str(tmp_path / "missing")) is None


if __name__ == "__main__":  # the other process's side of the test above
    print(json.dumps(_keys_and_hashes()))
