"""kvledger's chain keys against vLLM's block hasher, in microseconds per block.

Both hash the blocks of 2,000-token requests (125 blocks of 16 tokens) with
random token ids below 150,000. vLLM's is `get_request_block_hasher` with each
algorithm of 0.32 (sha256, its default, pickles the block's tuple). Then
kvledger's `ChainKeys` computing a request's keys at once, as a prefill gives
them, and one block per call, as a decode does; with a cache salt (only the
first block asks vLLM's `generate_block_hash_extra_keys`) and with a LoRA
(every block does); and the ways of turning a block's ids into bytes that
`ChainKeys` chose between. Best of several rounds: the machine is shared.

    python bench/chain_keys.py [--tokens 2000] [--block 16] [--rounds 7]
"""

from __future__ import annotations

import argparse
import random
import struct
import sys
import time
from array import array
from collections.abc import Callable
from functools import partial

import numpy as np
from xxhash import xxh3_128_digest


def best_us(run: Callable[[], object], count: int, rounds: int, inner: int = 20) -> float:
    """Microseconds per block: the best round's time over `inner` runs of `count` blocks."""
    best = float("inf")
    for _ in range(rounds):
        start = time.perf_counter()
        for _ in range(inner):
            run()
        best = min(best, time.perf_counter() - start)
    return best / inner / count * 1e6


def conversions(tokens: list[int], size: int) -> dict[str, Callable[[], object]]:
    """A chain of xxh3_128 digests over the blocks, with each way of packing the ids."""
    blocks = len(tokens) // size
    width = 4 * size
    root = b"root"
    per_block = struct.Struct(f"<{size}i").pack
    swap = sys.byteorder == "big"

    def struct_per_block():  # what ChainKeys does
        prev = root
        for start in range(0, blocks * size, size):
            prev = xxh3_128_digest(prev + per_block(*tokens[start:start + size]))
        return prev

    def whole(data: bytes):
        prev = root
        for b in range(blocks):
            prev = xxh3_128_digest(prev + data[b * width:(b + 1) * width])
        return prev

    def struct_whole():
        return whole(struct.pack(f"<{blocks * size}i", *tokens[:blocks * size]))

    def array_whole():
        ids = array("i", tokens[:blocks * size])
        if swap:
            ids.byteswap()
        return whole(ids.tobytes())

    def array_per_block():
        prev = root
        for start in range(0, blocks * size, size):
            ids = array("i", tokens[start:start + size])
            if swap:
                ids.byteswap()
            prev = xxh3_128_digest(prev + ids.tobytes())
        return prev

    def numpy_whole():
        return whole(np.array(tokens[:blocks * size], dtype="<i4").tobytes())

    found = {"struct, per block (chosen)": struct_per_block, "struct, whole request": struct_whole,
             "array('i'), whole request": array_whole, "array('i'), per block": array_per_block,
             "numpy, whole request": numpy_whole}
    assert len({run() for run in found.values()}) == 1
    return found


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--tokens", type=int, default=2000)
    parser.add_argument("--block", type=int, default=16)
    parser.add_argument("--rounds", type=int, default=7)
    args = parser.parse_args()

    from vllm.lora.request import LoRARequest
    from vllm.sampling_params import SamplingParams
    from vllm.utils.hashing import get_hash_fn_by_name
    from vllm.v1.core.kv_cache_utils import get_request_block_hasher, init_none_hash
    from vllm.v1.request import Request

    from kvledger.adapters.vllm.chain_keys import CRYPTOGRAPHIC, FAST, KEYED, ChainKeys

    size, rounds = args.block, args.rounds
    tokens = [random.Random(0).randrange(150_000) for _ in range(args.tokens)]
    blocks = len(tokens) // size
    params = SamplingParams(max_tokens=1)
    rows: list[tuple[str, float]] = []

    lora = LoRARequest("adapter", 1, "/adapters/adapter")
    for algorithm in ("sha256", "sha256_cbor", "xxhash", "xxhash_cbor"):
        hash_fn = get_hash_fn_by_name(algorithm)
        init_none_hash(hash_fn)
        hasher = get_request_block_hasher(size, hash_fn)
        bare = Request("r", tokens, params, None)  # no hashes yet: each call hashes every block
        default = " (default)" if algorithm == "sha256" else ""
        rows.append((f"vLLM block hasher, {algorithm}{default}", best_us(partial(hasher, bare), blocks, rounds)))
        if algorithm == "sha256":
            adapted = Request("l", tokens, params, None, lora_request=lora)
            rows.append(("vLLM block hasher, sha256, LoRA", best_us(partial(hasher, adapted), blocks, rounds)))

    init_none_hash(get_hash_fn_by_name("sha256"))
    hasher = get_request_block_hasher(size, get_hash_fn_by_name("sha256"))
    for label, extra in (("", {}), (", cache salt", {"cache_salt": "tenant"}), (", LoRA", {"lora_request": lora})):
        request = Request("r", tokens, params, None, block_hasher=hasher, **extra)
        chain_keys = ChainKeys(b"root", size)

        def at_once(request=request, chain_keys=chain_keys):
            chain_keys.forget("r")
            return chain_keys.keys(request)

        rows.append((f"ChainKeys, whole request{label}", best_us(at_once, blocks, rounds)))

    # The three ways a chain hashes (lower_tiers.block_keys picks): xxh3 (vLLM on xxhash),
    # BLAKE2b (vLLM on sha256, its default), BLAKE2b keyed with the tiers' secret.
    request = Request("r", tokens, params, None, block_hasher=hasher)
    for name, secret in ((FAST, None), (CRYPTOGRAPHIC, None), (KEYED, b"k" * 32)):
        chain_keys = ChainKeys(b"root", size, name, secret)

        def hashed(request=request, chain_keys=chain_keys):
            chain_keys.forget("r")
            return chain_keys.keys(request)

        rows.append((f"ChainKeys, whole request, {name}", best_us(hashed, blocks, rounds)))

    # One block per call, as decoding grows a request: time `keys` alone.
    best = float("inf")
    for _ in range(rounds):
        growing = Request("g", tokens[:size - 1], params, None, block_hasher=hasher)
        chain_keys = ChainKeys(b"root", size)
        spent = 0.0
        for start in range(size - 1, blocks * size, size):
            growing.append_output_token_ids(tokens[start:start + size])
            begin = time.perf_counter()
            chain_keys.keys(growing)
            spent += time.perf_counter() - begin
        best = min(best, spent / (blocks - 1) * 1e6)
    rows.append(("ChainKeys, one block per call", best))

    for name, run in conversions(tokens, size).items():
        rows.append((f"ids to bytes + xxh3_128 chain: {name}", best_us(run, blocks, rounds)))

    print(f"{args.tokens}-token requests, {blocks} blocks of {size} tokens, best of {rounds}")
    print(f"{'':<56} µs/block")
    for name, us in rows:
        print(f"{name:<56} {us:8.3f}")


if __name__ == "__main__":
    main()
