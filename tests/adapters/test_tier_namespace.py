"""Tier namespaces: a block is only ever read back by the model and KV layout that wrote it."""

from __future__ import annotations

import json
import os
import stat
import threading
from pathlib import Path
from types import SimpleNamespace

import pytest

pytest.importorskip("vllm", reason="needs the vllm package")  # before the imports that need it
import torch
from vllm.config import AttentionConfig, CacheConfig, DeviceConfig, ParallelConfig
from vllm.v1.core.kv_cache_utils import generate_scheduler_kv_cache_config
from vllm.v1.kv_cache_interface import (
    FullAttentionSpec,
    KVCacheConfig,
    KVCacheGroupSpec,
    KVCacheTensor,
    MambaSpec,
    MLAAttentionSpec,
    SlidingWindowSpec,
    UniformTypeKVCacheSpecs,
)

from kvledger.adapters.vllm import tier_namespace as tn
from tests.support.privileges import second_group
from tests.support.zygotes import run_under_another_seed

pytestmark = pytest.mark.vllm  # imports vLLM's types: not in the fast subset, which runs without vLLM

LAYERS = ("model.layers.0.self_attn.attn", "model.layers.1.self_attn.attn")
ROOT = Path(__file__).resolve().parents[2]


def full(**changes):
    return FullAttentionSpec(**{"block_size": 16, "num_kv_heads": 2, "head_size": 64, "dtype": torch.float16,
                                **changes})


def kv_cache_config(*specs, layers=LAYERS, hash_block_size=None, kv_cache_layout=None, kv_tp_replicas=1):
    specs = specs or (full(),)
    page = specs[0].page_size_bytes
    return KVCacheConfig(kv_tp_replicas=kv_tp_replicas,
        num_blocks=128,
        kv_cache_tensors=[KVCacheTensor(size=page * 128, layers=list(layers), layer_stride=page * 128,
                                        block_stride=page)],
        kv_cache_groups=[KVCacheGroupSpec(layer_names=list(layers), kv_cache_spec=spec) for spec in specs],
        hash_block_size=hash_block_size, kv_cache_layout=kv_cache_layout)


def mla_config(replicas=2):
    """An MLA model's KV: one latent, the same on every tensor-parallel rank (vLLM's kv_tp_replicas)."""
    spec = MLAAttentionSpec(block_size=16, num_kv_heads=1, head_size=576, dtype=torch.bfloat16, max_tp_shards=1)
    return kv_cache_config(spec, kv_tp_replicas=replicas)


def vllm_config(model="Qwen/Qwen3-0.6B", dtype=torch.bfloat16, revision=None, quantization=None,
                cache_dtype="auto", tp=1, pp=1, backend=None):
    """vLLM's own cache, parallel, attention and device configs (so the attribute
    names are checked); a stand-in model config, which would load the model's files."""
    attention = AttentionConfig() if backend is None else AttentionConfig(backend=backend)
    return SimpleNamespace(
        model_config=SimpleNamespace(model=model, dtype=dtype, revision=revision, quantization=quantization),
        cache_config=CacheConfig(cache_dtype=cache_dtype),
        parallel_config=ParallelConfig(tensor_parallel_size=tp, pipeline_parallel_size=pp),
        attention_config=attention,
        device_config=DeviceConfig(device="cpu"),
    )


def ident(config=None, kv=None, *, rank=0, world_size=1):
    return tn.identity(config or vllm_config(), kv or kv_cache_config(), rank=rank, world_size=world_size)


def test_the_identity_names_what_shapes_a_block():
    identity = ident(kv=kv_cache_config(hash_block_size=16))
    assert identity["format_version"] == tn.FORMAT_VERSION
    assert identity["model"] == {"name": "Qwen/Qwen3-0.6B", "dtype": "torch.bfloat16"}
    assert identity["cache_dtype"] == "auto"
    assert identity["hash_block_size"] == 16
    assert identity["device_type"] == "cpu"
    assert (identity["rank"], identity["parallel"]["world_size"], identity["parallel"]["tensor_parallel_size"],
            identity["parallel"]["pipeline_parallel_size"]) == (0, 1, 1, 1)
    group, = identity["groups"]
    assert group["spec"] == "FullAttentionSpec" and group["layers"] == list(LAYERS)
    assert (group["block_size"], group["page_size_bytes"], group["dtype"], group["num_kv_heads"]) == (
        16, full().page_size_bytes, "torch.float16", 2)
    assert json.loads(tn.canonical_json(identity)) == identity  # JSON-able, and nothing lost on the way


def test_the_digests_are_16_bytes_of_canonical_json():
    identity = ident()
    text = tn.canonical_json(identity)
    assert b" " not in text and text == json.dumps(identity, sort_keys=True, separators=(",", ":")).encode()
    assert len(tn.namespace(identity)) == len(tn.key_root(identity)) == 16
    assert tn.namespace(identity) != tn.key_root(identity)


def test_stable_across_calls():
    assert ident() == ident()
    assert tn.namespace(ident()) == tn.namespace(ident())
    assert tn.key_root(ident(rank=1, world_size=2)) == tn.key_root(ident(rank=1, world_size=2))


def _sliding_identity() -> dict:
    kv = kv_cache_config(full(), SlidingWindowSpec(block_size=16, num_kv_heads=2, head_size=64, dtype=torch.float16,
                                                    sliding_window=128))
    return ident(kv=kv, rank=1, world_size=2)


@pytest.mark.slow
def test_stable_across_processes_and_hash_seeds():
    there = run_under_another_seed("tests.adapters.test_tier_namespace").split()
    here = _sliding_identity()
    assert there == [tn.namespace(here).hex(), tn.key_root(here).hex()]


def test_ranks_with_identical_kv_share_one_namespace_and_keys():
    # MLA under TP=2: both ranks hold the same bytes, so a block is kept once for both.
    config, kv = vllm_config(tp=2), mla_config()
    assert tn.tp_replicas(config, kv, 2) == 2
    ranks = [ident(config, kv, rank=rank, world_size=2) for rank in (0, 1)]
    assert ranks[0] == ranks[1] and ranks[0]["rank"] == "0-1"
    assert tn.key_root(ranks[0]) == tn.key_root(ident(config, mla_config(replicas=1), rank=0, world_size=2))
    per_rank = [tn.namespace(ident(config, mla_config(replicas=1), rank=rank, world_size=2)) for rank in (0, 1)]
    assert tn.namespace(ranks[0]) not in per_rank and per_rank[0] != per_rank[1]


@pytest.mark.parametrize("config, world_size", [
    (vllm_config(tp=2, pp=2), 4),  # pipeline stages hold different layers
    (vllm_config(tp=1), 1),
    (vllm_config(tp=4), 2),  # a world that is not the tensor-parallel group
])
def test_ranks_share_bytes_only_under_tensor_parallelism_alone(config, world_size):
    assert tn.tp_replicas(config, mla_config(), world_size) == 1
    assert isinstance(ident(config, mla_config(), rank=world_size - 1, world_size=world_size)["rank"], int)


def _window(size):
    return SlidingWindowSpec(block_size=16, num_kv_heads=2, head_size=64, dtype=torch.float16, sliding_window=size)


# Each a change that makes the bytes of a block mean something else.
CHANGES = {
    "model": lambda: ident(vllm_config(model="Qwen/Qwen3-1.7B")),
    "revision": lambda: ident(vllm_config(revision="abc123")),
    "quantization": lambda: ident(vllm_config(quantization="fp8")),
    "model dtype": lambda: ident(vllm_config(dtype=torch.float16)),
    "cache dtype": lambda: ident(vllm_config(cache_dtype="fp8")),
    "spec dtype": lambda: ident(kv=kv_cache_config(full(dtype=torch.bfloat16))),
    "block size": lambda: ident(kv=kv_cache_config(full(block_size=32))),
    "kv heads": lambda: ident(kv=kv_cache_config(full(num_kv_heads=4))),
    "head size": lambda: ident(kv=kv_cache_config(full(head_size=128))),
    "window on a full spec": lambda: ident(kv=kv_cache_config(full(sliding_window=256))),
    "a sliding group": lambda: ident(kv=kv_cache_config(full(), _window(128))),
    "page padding": lambda: ident(kv=kv_cache_config(full(page_size_padded=full().page_size_bytes + 64))),
    "layer names": lambda: ident(kv=kv_cache_config(layers=("a.0", "a.1"))),
    "hash block size": lambda: ident(kv=kv_cache_config(hash_block_size=8)),
    "kv cache layout": lambda: ident(kv=kv_cache_config(kv_cache_layout="HND")),
    "pipeline parallel": lambda: ident(vllm_config(pp=2)),
    "tp size": lambda: ident(vllm_config(tp=2), world_size=2),
    "attention backend": lambda: ident(vllm_config(backend="CPU_ATTN")),
}


@pytest.mark.parametrize("change", sorted(CHANGES))
def test_every_change_to_the_bytes_changes_the_namespace_and_the_keys(change):
    changed = CHANGES[change]()
    assert tn.namespace(changed) != tn.namespace(ident())
    assert tn.key_root(changed) != tn.key_root(ident())


def test_a_weights_version_changes_the_namespace_and_the_keys():
    # New weights under the same model path: only the operator can say so.
    base = ident()
    named = tn.identity(vllm_config(), kv_cache_config(), rank=0, world_size=1, weights_version="step-1200")
    assert named["model"]["weights_version"] == "step-1200"
    other = tn.identity(vllm_config(), kv_cache_config(), rank=0, world_size=1, weights_version="step-1300")
    assert len({tn.namespace(i) for i in (base, named, other)}) == 3
    assert len({tn.key_root(i) for i in (base, named, other)}) == 3


def test_a_window_change_changes_the_namespace():
    one, other = (ident(kv=kv_cache_config(full(), _window(size))) for size in (128, 256))
    assert one["groups"][1]["sliding_window"] == 128
    assert tn.namespace(one) != tn.namespace(other) and tn.key_root(one) != tn.key_root(other)


def test_a_format_version_change_changes_the_namespace(monkeypatch):
    before = ident()
    monkeypatch.setattr(tn, "FORMAT_VERSION", tn.FORMAT_VERSION + 1)
    after = ident()
    assert after["format_version"] == before["format_version"] + 1
    assert tn.namespace(after) != tn.namespace(before) and tn.key_root(after) != tn.key_root(before)


def test_ranks_share_the_key_root_and_not_the_namespace():
    ranks = [ident(vllm_config(tp=4), rank=rank, world_size=4) for rank in range(4)]
    assert len({tn.key_root(i) for i in ranks}) == 1
    assert len({tn.namespace(i) for i in ranks}) == 4


def test_mamba_shapes_and_dtypes_are_part_of_it():
    def mamba(shapes=((4, 8), (16,)), dtypes=(torch.float16, torch.float32)):
        return ident(kv=kv_cache_config(full(), MambaSpec(block_size=16, shapes=shapes, dtypes=dtypes)))

    group = mamba()["groups"][1]
    assert (group["spec"], group["shapes"], group["dtypes"]) == (
        "MambaSpec", [[4, 8], [16]], ["torch.float16", "torch.float32"])
    assert group["mamba_type"] == "MAMBA2"  # an enum by name
    assert len({tn.namespace(i) for i in (mamba(), mamba(shapes=((4, 16), (16,))),
                                          mamba(dtypes=(torch.float32, torch.float32)))}) == 3


def test_the_scheduler_derives_each_workers_namespace_from_its_own_config():
    """The scheduler's config is vLLM's copy of a worker's, with a uniform-type
    group replaced by its first layer's spec: both must give the same identity."""
    specs = {LAYERS[0]: full(), LAYERS[1]: full(head_size=128)}
    worker = kv_cache_config(UniformTypeKVCacheSpecs(block_size=16, kv_cache_specs=specs), _window(128),
                             hash_block_size=16)
    scheduler = generate_scheduler_kv_cache_config([worker])
    assert type(scheduler.kv_cache_groups[0].kv_cache_spec) is FullAttentionSpec  # what vLLM does
    config = vllm_config(tp=2)
    for rank in range(2):
        on_worker = tn.identity(config, worker, rank=rank, world_size=2)
        assert on_worker == tn.identity(config, scheduler, rank=rank, world_size=2)
    group = on_worker["groups"][0]
    assert (group["spec"], group["head_size"], group["layers"]) == ("FullAttentionSpec", 64, list(LAYERS))


def test_fields_a_config_lacks_are_left_out():
    bare = SimpleNamespace(model_config=SimpleNamespace(model="m", dtype="auto"),
                           cache_config=SimpleNamespace(cache_dtype="auto"))
    identity = tn.identity(bare, kv_cache_config(), rank=0, world_size=1)
    assert identity["model"] == {"name": "m", "dtype": "auto"}
    assert identity["parallel"] == {"world_size": 1}
    assert "hash_block_size" not in identity and "attention_backend" not in identity
    assert json.loads(tn.canonical_json(identity)) == identity


def test_a_value_without_a_stable_form_is_refused():
    odd = SimpleNamespace(block_size=16, dtype=object())
    config = SimpleNamespace(kv_cache_groups=[SimpleNamespace(kv_cache_spec=odd, layer_names=["x"])])
    with pytest.raises(TypeError, match=r"kv_cache_groups\[0\]\.dtype: no stable JSON form for object"):
        tn.identity(vllm_config(), config, rank=0, world_size=1)


def test_the_identity_is_written_beside_the_blocks(tmp_path):
    identity = ident()
    space = tn.namespace(identity)
    tn.write_identity(tmp_path, space, identity)
    path = tmp_path / space.hex() / "NAMESPACE.json"
    assert json.loads(path.read_text()) == identity
    before = path.stat()
    tn.write_identity(str(tmp_path), space, identity)  # the same content: left alone
    after = path.stat()
    assert (after.st_ino, after.st_mtime_ns) == (before.st_ino, before.st_mtime_ns)
    path.write_text("{}")  # damaged: rewritten
    tn.write_identity(tmp_path, space, identity)
    assert json.loads(path.read_text()) == identity
    assert [p.name for p in path.parent.iterdir()] == ["NAMESPACE.json"]  # nothing left aside


def test_an_identity_is_never_written_under_another_namespace(tmp_path):
    with pytest.raises(ValueError, match="is not the digest of this identity"):
        tn.write_identity(tmp_path, tn.namespace(ident(rank=1, world_size=2)), ident())
    assert list(tmp_path.iterdir()) == []


def test_the_identity_is_the_users_alone_or_the_tiers_groups(tmp_path):
    """It sits among the blocks: its directory and it get the tier's modes, whatever the umask."""
    identity = ident()
    space = tn.namespace(identity)
    _name, group = second_group()
    for root, gid, modes in ((tmp_path / "own", None, (0o600, 0o700)), (tmp_path / "shared", group, (0o660, 0o2770))):
        root.mkdir()
        old = os.umask(0o077)
        try:
            tn.write_identity(root, space, identity, gid=gid)
        finally:
            os.umask(old)
        path = root / space.hex() / "NAMESPACE.json"
        assert (stat.S_IMODE(path.stat().st_mode), stat.S_IMODE(path.parent.stat().st_mode)) == modes
        assert gid is None or path.stat().st_gid == path.parent.stat().st_gid == gid


def test_links_planted_at_the_identitys_aside_names_are_not_followed(tmp_path):
    """The aside name was the pid and a counter: links planted at the names to come made this
    process write the identity into any file it could write."""
    identity = ident()
    space = tn.namespace(identity)
    directory = tmp_path / space.hex()
    directory.mkdir()
    victim = tmp_path / "victim"
    victim.write_text("keep")
    for number in range(256):  # every name the counter gives this process's first 256 writes
        (directory / f"NAMESPACE.json.{os.getpid()}.{number}.tmp").symlink_to(victim)
    tn.write_identity(tmp_path, space, identity)
    assert victim.read_text() == "keep"
    assert json.loads((directory / "NAMESPACE.json").read_text()) == identity


def test_a_link_or_a_fifo_at_the_identity_is_replaced_not_read_through(tmp_path):
    """A link to a file saying the same was kept (read through, found equal); a FIFO hung the start."""
    identity = ident()
    space = tn.namespace(identity)
    path = tmp_path / space.hex() / "NAMESPACE.json"
    path.parent.mkdir()
    same = tmp_path / "same.json"
    same.write_text(json.dumps(identity, sort_keys=True, indent=2) + "\n")
    path.symlink_to(same)
    tn.write_identity(tmp_path, space, identity)
    assert not path.is_symlink() and json.loads(path.read_text()) == identity
    path.unlink()
    os.mkfifo(path)
    writer = threading.Thread(target=tn.write_identity, args=(tmp_path, space, identity), daemon=True)
    writer.start()
    writer.join(1.0)
    try:
        assert not writer.is_alive(), "the identity's read waits on the FIFO"
    finally:
        if writer.is_alive():
            os.close(os.open(path, os.O_WRONLY | os.O_NONBLOCK))
    assert stat.S_ISREG(path.lstat().st_mode) and json.loads(path.read_text()) == identity


if __name__ == "__main__":  # the other process's side of test_stable_across_processes_and_hash_seeds
    print(tn.namespace(_sliding_identity()).hex(), tn.key_root(_sliding_identity()).hex())
