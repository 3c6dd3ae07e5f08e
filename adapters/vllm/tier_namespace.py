"""What a persistent tier's blocks mean: the identity of the model and KV layout that wrote them.

A block file outlives the process that wrote it, and a shared directory is
read by other processes. Its bytes are only meaningful to a reader with the
same model weights, KV dtype, page layout, block size and shard, so each
block file carries a 16-byte namespace in its header
(`transfers/lower_tiers/block_header.py`) and lives under
`root/<namespace hex>/`: a reader that differs in any of these looks
in another directory, and a file moved across is refused by its header.

`identity` gathers those facts from vLLM's configs as a JSON-able dict;
`namespace` digests it. `key_root` digests it without the rank, so every
tensor-parallel rank derives the same block keys while each writes its own
shard under its own namespace. Ranks whose KV is byte-identical (vLLM's
`kv_tp_replicas`: an MLA latent is the same on every tensor-parallel rank)
share one namespace, so a block is kept once for them (`tp_replicas`). The
scheduler derives every rank's namespace from its own copy of the configs,
so the identity holds only facts that copy shares with each worker's. `write_identity` leaves the dict beside the
blocks, so an operator can tell what a directory holds.

Reads use getattr with defaults: a field this vLLM lacks is left out, and a
field a later vLLM adds does not change the namespace until it is named here.
Anything missing from the identity that changes the bytes would let one
model read another's KV, so when in doubt a fact belongs in it: the price
of one too many is a cold tier after a change, not wrong output.
"""

from __future__ import annotations

import contextlib
import enum
import hashlib
import json
import os
import stat
from collections.abc import Mapping
from fractions import Fraction
from pathlib import Path
from typing import Any

from kvledger.transfers.lower_tiers.block_header import FORMAT_VERSION, NAMESPACE_BYTES
from kvledger.transfers.lower_tiers.fs.block_file import aside_path, create_file, make_dir
from kvledger.transfers.lower_tiers.fs.tier import IDENTITY_FILE

# Per KV cache spec: what shapes a block's bytes, read where the spec has it.
# page_size_bytes covers heads, head sizes, dtype and padding together; the
# parts are named too, so a namespace file says what the page holds.
_SPEC_FIELDS = (
    "block_size", "page_size_bytes", "num_kv_heads", "head_size", "head_size_v", "dtype",
    "kv_quant_mode", "num_head_slots", "state_content_bytes", "tokens_per_state", "dcp_sharded",
    "sliding_window", "extra_retained_tokens", "attention_chunk_size", "cache_dtype_str",
    "shapes", "dtypes", "mamba_type", "mamba_cache_mode",
)
# Parallelism that changes which share of a block a worker holds.
_PARALLEL_FIELDS = (
    "tensor_parallel_size", "pipeline_parallel_size", "decode_context_parallel_size",
    "prefill_context_parallel_size", "dcp_kv_cache_interleave_size", "cp_kv_cache_interleave_size",
)
_HF_SET_AT_LOAD = frozenset(("torch_dtype", "dtype", "transformers_version"))
_RANK = "rank"
_MISSING = object()


def _read(obj: Any, name: str) -> Any:
    """`obj.name`, or `_MISSING` where it is absent or None (a property may raise)."""
    try:
        value = getattr(obj, name)
    except (AttributeError, NotImplementedError):
        return _MISSING
    return _MISSING if value is None else value


def _plain(value: Any, where: str) -> Any:
    """A JSON value for `value`, the same in every process (never a repr with an address)."""
    if isinstance(value, (bool, str)) or value is None:
        return value
    if isinstance(value, enum.Enum):  # before int: an IntEnum is an int
        return value.name
    if isinstance(value, int):
        return int(value)
    if isinstance(value, Fraction):
        return str(value)
    if isinstance(value, (tuple, list)):
        return [_plain(v, where) for v in value]
    if isinstance(value, Mapping):
        return {str(k): _plain(v, f"{where}.{k}") for k, v in value.items()}
    if type(value).__module__ == "torch" and type(value).__name__ == "dtype":
        return str(value)  # "torch.bfloat16"
    raise TypeError(f"{where}: no stable JSON form for {type(value).__name__} {value!r}")


def _fields(obj: Any, names: tuple[str, ...], where: str) -> dict[str, Any]:
    out = {}
    for name in names:
        value = _read(obj, name)
        if value is not _MISSING:
            out[name] = _plain(value, f"{where}.{name}")
    return out


def _spec(spec: Any, where: str) -> dict[str, Any]:
    inner = _read(spec, "kv_cache_specs")
    if inner is not _MISSING and inner:
        # UniformTypeKVCacheSpecs (a spec per layer): the scheduler's copy of the
        # config holds its first layer's spec instead (vLLM's
        # generate_scheduler_kv_cache_config), and the scheduler derives every
        # rank's namespace, so both sides describe the group by that spec. The
        # other layers' specs follow from the model.
        spec = next(iter(inner.values()))
    return {"spec": type(spec).__name__, **_fields(spec, _SPEC_FIELDS, where)}


def identity(vllm_config: Any, kv_cache_config: Any, *, rank: int, world_size: int,
             weights_version: str | None = None, block_keys: str | None = None,
             naming: str | None = None) -> dict[str, Any]:
    """Everything that makes this worker's block bytes meaningful, as a JSON-able dict.
    `weights_version` is the operator's name for the weights (the setting of that
    name): vLLM's configs cannot tell new weights under the same model path.
    `block_keys` names the keys' hash (`chain_keys`): blocks keyed another way
    live in another directory, not as files no key ever finds. `naming`, a
    fingerprint of the tiers' naming key (`lower_tiers.naming_fingerprint`):
    deployments under other secrets never share a directory, so none adopts,
    counts, evicts or resets another's blocks."""
    model_config = vllm_config.model_config
    cache_config = vllm_config.cache_config
    parallel_config = _read(vllm_config, "parallel_config")
    model = {"name": str(model_config.model), "dtype": str(model_config.dtype)}
    for name in ("revision", "quantization"):
        value = _read(model_config, name)
        if value is not _MISSING:
            model[name] = str(value)
    if weights_version is not None:
        model["weights_version"] = weights_version
    hf = _hf_config_digest(model_config)
    if hf is not None:
        model["hf_config"] = hf

    out: dict[str, Any] = {
        "format_version": FORMAT_VERSION,
        "model": model,
        "cache_dtype": str(cache_config.cache_dtype),
        "groups": [
            {**_spec(group.kv_cache_spec, f"kv_cache_groups[{index}]"), "layers": list(group.layer_names)}
            for index, group in enumerate(kv_cache_config.kv_cache_groups)
        ],
    }
    skipped = _read(cache_config, "kv_cache_dtype_skip_layers")  # layers kept out of a quantized KV dtype
    if skipped is not _MISSING and skipped:
        out["cache_dtype_skip_layers"] = sorted(map(str, skipped))
    # From the KV cache config only: the engine core resolves both into it before
    # the scheduler and the workers get their copies. cache_config's fields of
    # the same names are set at run time, in each process on its own schedule.
    for name in ("hash_block_size", "kv_cache_layout"):
        value = _read(kv_cache_config, name)
        if value is not _MISSING:
            out[name] = _plain(value, name)
    backend = _read(_read(vllm_config, "attention_config"), "backend")  # the page's byte order
    if backend is not _MISSING:
        out["attention_backend"] = _plain(backend, "attention_backend")
    device = _read(_read(vllm_config, "device_config"), "device_type")
    if device is not _MISSING:
        out["device_type"] = str(device)
    if block_keys is not None:
        out["block_keys"] = block_keys
    if naming is not None:
        out["naming"] = naming
    out["parallel"] = {"world_size": int(world_size), **_fields(parallel_config, _PARALLEL_FIELDS, "parallel")}
    replicas = tp_replicas(vllm_config, kv_cache_config, world_size)
    first = rank - rank % replicas
    out[_RANK] = int(rank) if replicas == 1 else f"{first}-{first + replicas - 1}"  # the ranks sharing these bytes
    return out


def _hf_config_digest(model_config: Any) -> str | None:
    """A digest of the model's Hugging Face config as vLLM loaded it, overrides
    applied (`hf_overrides`, rope scaling, ...): a changed config under the same
    path changes what the KV means. None where this config cannot say."""
    config = _read(model_config, "hf_config")
    to_json = getattr(config, "to_json_string", None)
    if to_json is None:
        return None
    try:
        fields = json.loads(to_json(use_diff=False))
    except (TypeError, ValueError):  # a value json cannot write: left out, as a field this vLLM lacks
        return None
    # Private fields (`_attn_implementation_autoset`, ...) are set while a worker loads the model, after
    # the scheduler has taken its copy; the dtype is in the identity on its own.
    text = canonical_json({k: v for k, v in fields.items() if not k.startswith("_") and k not in _HF_SET_AT_LOAD}).decode()
    overrides = _read(model_config, "hf_overrides")
    if overrides is not _MISSING and overrides:
        # A callable is named by where it lives; its effect is in the config already.
        shown = (f"{getattr(overrides, '__module__', '')}.{getattr(overrides, '__qualname__', '')}"
                 if callable(overrides) else json.dumps(overrides, sort_keys=True, default=str))
        text += "\n" + shown
    return hashlib.blake2b(text.encode(), digest_size=16).hexdigest()


def tp_replicas(vllm_config: Any, kv_cache_config: Any, world_size: int) -> int:
    """How many consecutive ranks hold byte-identical KV and may share one copy
    of a block: vLLM's `kv_tp_replicas` (world_size for an MLA model), under
    tensor parallelism alone. 1 (every rank its own shard) with pipeline or
    context parallelism, or where this vLLM does not say."""
    replicas = _read(kv_cache_config, "kv_tp_replicas")
    if not isinstance(replicas, int) or isinstance(replicas, bool) or replicas <= 1:
        return 1
    parallel = _read(vllm_config, "parallel_config")
    if _read(parallel, "tensor_parallel_size") != world_size or world_size % replicas:
        return 1
    others = ("pipeline_parallel_size", "decode_context_parallel_size", "prefill_context_parallel_size")
    if any(_read(parallel, name) not in (_MISSING, 1) for name in others):
        return 1
    return replicas


def canonical_json(identity: Mapping[str, Any]) -> bytes:
    return json.dumps(identity, sort_keys=True, separators=(",", ":"), allow_nan=False).encode()


def _digest(identity: Mapping[str, Any]) -> bytes:
    return hashlib.blake2b(canonical_json(identity), digest_size=NAMESPACE_BYTES).digest()


def namespace(identity: Mapping[str, Any]) -> bytes:
    """16 bytes naming the directory, and stamped in the header, of this worker's block files."""
    return _digest(identity)


def key_root(identity: Mapping[str, Any]) -> bytes:
    """16 bytes to start the stable key chain from: the identity without the
    rank, so every tensor-parallel rank derives the same keys."""
    return _digest({k: v for k, v in identity.items() if k != _RANK})


def write_identity(root: str | os.PathLike, namespace: bytes, identity: Mapping[str, Any], *,
                   gid: int | None = None, directory_fd: int | None = None) -> None:
    """`root/<namespace hex>/NAMESPACE.json`: the identity, for operators. Written
    aside and renamed into place; left alone where it already says the same.
    The directory and the file get the tier's modes (`gid`: its group, as
    `FsTierSettings.gid`). The aside name is unpredictable and made with
    O_EXCL|O_NOFOLLOW, and the file is read without following a link: whoever
    can write the directory cannot plant a link that this process writes or reads through.
    `directory_fd`: the namespace's directory, already open (the disk tier's, held by
    descriptor: `tier_dir`), where the file is then written by name alone."""
    if namespace != _digest(identity):
        raise ValueError(f"namespace {namespace.hex()} is not the digest of this identity "
                         f"({_digest(identity).hex()})")
    directory = Path(root) / namespace.hex()
    path = Path(IDENTITY_FILE) if directory_fd is not None else directory / IDENTITY_FILE
    text = json.dumps(identity, sort_keys=True, indent=2, allow_nan=False) + "\n"
    data = text.encode()
    if _existing_bytes(path, len(data), directory_fd) == data:
        return
    if directory_fd is None:
        make_dir(directory, gid)
    aside = aside_path(path)
    try:
        with os.fdopen(create_file(aside, gid, dir_fd=directory_fd), "wb") as out:
            out.write(data)
        os.replace(aside, path, src_dir_fd=directory_fd, dst_dir_fd=directory_fd)
    except BaseException:
        with contextlib.suppress(FileNotFoundError):
            os.unlink(aside, dir_fd=directory_fd)
        raise


def _existing_bytes(path: Path, limit: int, dir_fd: int | None = None) -> bytes | None:
    """The file's bytes if it is a regular file of at most `limit` bytes, read
    never through a link nor waiting on a FIFO; None for anything else."""
    try:
        fd = os.open(path, os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK | os.O_NOCTTY | os.O_CLOEXEC, dir_fd=dir_fd)
    except OSError:  # missing, a link, unreadable: written anew
        return None
    with os.fdopen(fd, "rb") as file:
        if not stat.S_ISREG(os.fstat(fd).st_mode):
            return None
        data = file.read(limit + 1)
    return data if len(data) <= limit else None
