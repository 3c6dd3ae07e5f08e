"""KV cache layouts as vLLM registers them, built with torch on CPU.

Each builder returns a `Case`: the per-layer tensors and config handed to
`canonicalize`, the raw allocations behind them, and for every layer a
function giving the views of one manager block, written independently of the
layout code (the builder knows where it put each block).
"""

from __future__ import annotations

import math
from collections.abc import Callable

import attrs
import torch

from kvledger.transfers.copies.kv_spec import (
    FullAttentionSpec,
    KVCacheConfig,
    KVCacheGroupSpec,
    MambaSpec,
    MLAAttentionSpec,
    SlidingWindowSpec,
    UniformTypeKVCacheSpecs,
)

BlockViews = Callable[[int], list[torch.Tensor]]


@attrs.frozen(eq=False)
class Case:
    name: str
    kv_caches: dict
    config: KVCacheConfig
    raws: list[torch.Tensor]  # int8 allocations that hold every byte
    block_views: dict[str, BlockViews]

    @property
    def num_blocks(self) -> int:
        return self.config.num_blocks

    def group_layers(self, group: int) -> tuple[str, ...]:
        return self.config.kv_cache_groups[group].layer_names


def _esize(dtype: torch.dtype) -> int:
    return torch.empty((), dtype=dtype).element_size()


def _raw(nbytes: int) -> torch.Tensor:
    return torch.randint(-128, 128, (nbytes,), dtype=torch.int8)


def _config(num_blocks: int, groups: list[tuple[list[str], object]]) -> KVCacheConfig:
    return KVCacheConfig(
        num_blocks=num_blocks,
        kv_cache_groups=[KVCacheGroupSpec(layer_names=names, kv_cache_spec=spec) for names, spec in groups],
    )


def _rows(kernel: int) -> Callable[[torch.Tensor], BlockViews]:
    """Block b of a block-dim-0 tensor is its rows [b*k, (b+1)*k)."""
    return lambda t: (lambda b: [t[b * kernel : (b + 1) * kernel]])


def _split_rows(tensor: torch.Tensor, kernel: int) -> BlockViews:
    """Block b of a `(2, num_blocks * k, ...)` tensor: its K and V kernel blocks."""
    return lambda b: [tensor[:, b * kernel : (b + 1) * kernel]]


def _state_rows(states: list[torch.Tensor]) -> BlockViews:
    """Block b of a mamba layer: row b of each state tensor."""
    return lambda b: [t[b] for t in states]


def cpu_attention(
    num_blocks: int = 6,
    num_layers: int = 2,
    heads: int = 2,
    block_size: int = 4,
    head: int = 8,
    dtype: torch.dtype = torch.float32,
    packing: str = "layer",
    kernel: int = 1,
) -> Case:
    """vLLM-CPU: `(num_blocks, kv_heads, block_size, 2*head)`, one allocation for all layers."""
    spec = FullAttentionSpec(block_size=block_size, num_kv_heads=heads, head_size=head, dtype=dtype)
    page = spec.page_size_bytes
    shape = (heads, block_size // kernel, 2 * head)
    names = [f"layers.{i}.attn" for i in range(num_layers)]
    raw = _raw(num_layers * num_blocks * page)
    typed = raw.view(dtype)
    if packing == "layer":
        tensors = typed.view(num_layers, num_blocks * kernel, *shape).unbind(0)
    elif packing == "block":
        assert kernel == 1, "vLLM splits kernel blocks only in dense pages"
        tensors = typed.view(num_blocks, num_layers, *shape).unbind(1)
    else:
        raise ValueError(packing)
    return Case(
        name=f"cpu-{packing}-k{kernel}",
        kv_caches=dict(zip(names, tensors)),
        config=_config(num_blocks, [(names, spec)]),
        raws=[raw],
        block_views={n: _rows(kernel)(t) for n, t in zip(names, tensors)},
    )


def flash_attention(
    num_blocks: int = 6,
    num_layers: int = 2,
    heads: int = 2,
    block_size: int = 4,
    head: int = 8,
    dtype: torch.dtype = torch.float16,
    kv_outer: bool = True,
    hnd: bool = False,
    kernel: int = 1,
) -> Case:
    """Split K/V: `(2, num_blocks, block, heads, head)` (FlashAttention) or
    `(num_blocks, 2, block, heads, head)` (FlashInfer); HND strides keep the
    logical shape and put heads outside tokens in memory."""
    spec = FullAttentionSpec(block_size=block_size, num_kv_heads=heads, head_size=head, dtype=dtype)
    nbk, bs = num_blocks * kernel, block_size // kernel
    names = [f"layers.{i}.attn" for i in range(num_layers)]
    raw = _raw(num_layers * num_blocks * spec.page_size_bytes)
    typed = raw.view(dtype)
    inner = (heads, bs, head) if hnd else (bs, heads, head)
    outer = (2, nbk) if kv_outer else (nbk, 2)
    tensors = []
    for layer in typed.view(num_layers, -1).unbind(0):
        t = layer.view(*outer, *inner)
        tensors.append(t.transpose(2, 3) if hnd else t)
    if kv_outer:
        views = {n: _split_rows(t, kernel) for n, t in zip(names, tensors)}
    else:
        views = {n: _rows(kernel)(t) for n, t in zip(names, tensors)}
    return Case(
        name=f"flash-{'kv' if kv_outer else 'nb'}-{'hnd' if hnd else 'nhd'}-k{kernel}",
        kv_caches=dict(zip(names, tensors)),
        config=_config(num_blocks, [(names, spec)]),
        raws=[raw],
        block_views=views,
    )


def mla(
    num_blocks: int = 6,
    num_layers: int = 2,
    block_size: int = 4,
    latent: int = 24,
    dtype: torch.dtype = torch.bfloat16,
    padded_bytes: int | None = None,
) -> Case:
    """MLA: `(num_blocks, block_size, latent)`, pages optionally padded (block stride > page)."""
    spec = MLAAttentionSpec(
        block_size=block_size, num_kv_heads=1, head_size=latent, dtype=dtype, page_size_padded=padded_bytes
    )
    page, es = spec.page_size_bytes, _esize(dtype)
    names = [f"layers.{i}.mla" for i in range(num_layers)]
    raw = _raw(num_layers * num_blocks * page)
    typed = raw.view(dtype)
    tensors = [
        torch.as_strided(typed, (num_blocks, block_size, latent), (page // es, latent, 1), i * num_blocks * page // es)
        for i in range(num_layers)
    ]
    return Case(
        name=f"mla-pad{padded_bytes}",
        kv_caches=dict(zip(names, tensors)),
        config=_config(num_blocks, [(names, spec)]),
        raws=[raw],
        block_views={n: _rows(1)(t) for n, t in zip(names, tensors)},
    )


def _mamba_states(typed_raw: dict, base: int, num_blocks: int, page: int, shapes, dtypes) -> list[torch.Tensor]:
    """Conv then ssm state, packed at the start of each (padded) page."""
    states, offset = [], base
    for shape, dtype in zip(shapes, dtypes):
        es = _esize(dtype)
        assert offset % es == 0 and page % es == 0
        contiguous = torch.empty(shape).stride()
        states.append(
            torch.as_strided(typed_raw[dtype], (num_blocks, *shape), (page // es, *contiguous), offset // es)
        )
        offset += math.prod(shape) * es
    return states


def mamba(
    num_blocks: int = 6,
    num_layers: int = 2,
    conv_shape: tuple[int, ...] = (3, 8),
    ssm_shape: tuple[int, ...] = (2, 4, 4),
    dtypes: tuple[torch.dtype, torch.dtype] = (torch.bfloat16, torch.float32),
    padded_bytes: int | None = 256,
) -> Case:
    """Mamba: per layer a conv and an ssm state tensor `(num_blocks, *shape)`
    sharing one page per block, padded to `padded_bytes`."""
    spec = MambaSpec(block_size=16, shapes=(conv_shape, ssm_shape), dtypes=dtypes, page_size_padded=padded_bytes)
    page = spec.page_size_bytes
    names = [f"layers.{i}.mixer" for i in range(num_layers)]
    raw = _raw(num_layers * num_blocks * page)
    typed = {d: raw.view(d) for d in set(dtypes)}
    tensors = [_mamba_states(typed, i * num_blocks * page, num_blocks, page, spec.shapes, dtypes) for i in range(num_layers)]
    return Case(
        name=f"mamba-pad{padded_bytes}",
        kv_caches=dict(zip(names, tensors)),
        config=_config(num_blocks, [(names, spec)]),
        raws=[raw],
        block_views={n: _state_rows(ts) for n, ts in zip(names, tensors)},
    )


def hybrid_sliding(num_blocks: int = 8, packing: str = "layer") -> Case:
    """Gemma3 under HMA: a sliding and a full group whose layers overlay the
    same allocations pairwise (layers 0 and 1 share memory, so do 2 and 3)."""
    heads, block_size, head, dtype = 2, 4, 8, torch.float32
    full = FullAttentionSpec(block_size=block_size, num_kv_heads=heads, head_size=head, dtype=dtype)
    sliding = SlidingWindowSpec(
        block_size=block_size, num_kv_heads=heads, head_size=head, dtype=dtype, sliding_window=8
    )
    page = full.page_size_bytes
    shape = (heads, block_size, 2 * head)
    if packing == "layer":
        raws = [_raw(num_blocks * page) for _ in range(2)]
        shared = [r.view(dtype).view(num_blocks, *shape) for r in raws]
    else:
        raws = [_raw(num_blocks * 2 * page)]
        shared = list(raws[0].view(dtype).view(num_blocks, 2, *shape).unbind(1))
    names = ["layers.0.attn", "layers.1.attn", "layers.2.attn", "layers.3.attn"]
    tensors = [shared[0], shared[0], shared[1], shared[1]]
    return Case(
        name=f"hma-sliding-{packing}",
        kv_caches=dict(zip(names, tensors)),
        config=_config(num_blocks, [([names[0], names[2]], sliding), ([names[1], names[3]], full)]),
        raws=raws,
        block_views={n: _rows(1)(t) for n, t in zip(names, tensors)},
    )


def hybrid_mamba(num_blocks: int = 8) -> Case:
    """Attention and mamba groups overlaying one allocation per layer pair; the
    attention page is padded up to the mamba page so both share one stride."""
    conv_shape, ssm_shape, dtypes = (3, 8), (2, 4, 4), (torch.bfloat16, torch.float32)
    mamba_spec = MambaSpec(block_size=16, shapes=(conv_shape, ssm_shape), dtypes=dtypes)
    heads, head, dtype = 1, 8, torch.float16
    attn_unpadded = FullAttentionSpec(block_size=16, num_kv_heads=heads, head_size=head, dtype=dtype)
    page = max(mamba_spec.page_size_bytes, attn_unpadded.page_size_bytes)
    page = -(-page // 64) * 64
    mamba_spec = attrs.evolve(mamba_spec, page_size_padded=page)
    attn = attrs.evolve(attn_unpadded, page_size_padded=page)
    raws = [_raw(num_blocks * page) for _ in range(2)]
    names = ["layers.0.attn", "layers.1.attn", "layers.0.mixer", "layers.1.mixer"]
    attn_tensors = [
        torch.as_strided(r.view(dtype), (num_blocks, heads, 16, 2 * head), (page // 2, 16 * 2 * head, 2 * head, 1))
        for r in raws
    ]
    mamba_tensors = [
        _mamba_states({d: r.view(d) for d in set(dtypes)}, 0, num_blocks, page, mamba_spec.shapes, dtypes) for r in raws
    ]
    views = {n: _rows(1)(t) for n, t in zip(names[:2], attn_tensors)}
    views.update({n: _state_rows(ts) for n, ts in zip(names[2:], mamba_tensors)})
    return Case(
        name="hma-mamba",
        kv_caches={**dict(zip(names[:2], attn_tensors)), **dict(zip(names[2:], mamba_tensors))},
        config=_config(num_blocks, [(names[:2], attn), (names[2:], mamba_spec)]),
        raws=raws,
        block_views=views,
    )


def packed_uniform(num_blocks: int = 6) -> Case:
    """Block-outermost packing of layers with different page sizes in one group
    (per-layer specs), as DeepSeek-V4's MLA layers are laid out."""
    dtype, block_size = torch.bfloat16, 4
    specs = {
        "layers.0.mla": MLAAttentionSpec(block_size=block_size, num_kv_heads=1, head_size=16, dtype=dtype),
        "layers.1.mla": MLAAttentionSpec(block_size=block_size, num_kv_heads=1, head_size=40, dtype=dtype),
    }
    pages = [s.page_size_bytes for s in specs.values()]
    raw = _raw(num_blocks * sum(pages))
    rows = raw.view(num_blocks, sum(pages))
    tensors, offset = [], 0
    for spec, page in zip(specs.values(), pages):
        tensors.append(rows[:, offset : offset + page].view(dtype).view(num_blocks, block_size, spec.head_size))
        offset += page
    names = list(specs)
    group = UniformTypeKVCacheSpecs(block_size=block_size, kv_cache_specs=specs)
    return Case(
        name="packed-uniform",
        kv_caches=dict(zip(names, tensors)),
        config=_config(num_blocks, [(names, group)]),
        raws=[raw],
        block_views={n: _rows(1)(t) for n, t in zip(names, tensors)},
    )


def all_cases() -> list[Case]:
    return [
        cpu_attention(packing="layer"),
        cpu_attention(packing="block"),
        cpu_attention(kernel=2),
        flash_attention(kv_outer=True, hnd=False),
        flash_attention(kv_outer=True, hnd=True),
        flash_attention(kv_outer=False, hnd=False),
        flash_attention(kv_outer=False, hnd=True),
        flash_attention(kv_outer=True, hnd=True, kernel=2),
        mla(),
        mla(padded_bytes=256),
        mamba(padded_bytes=None),
        mamba(padded_bytes=256),
        hybrid_sliding(packing="layer"),
        hybrid_sliding(packing="block"),
        hybrid_mamba(),
        packed_uniform(),
    ]


def byte_addresses(view: torch.Tensor) -> torch.Tensor:
    """Absolute address of every byte a view covers, from its strides alone."""
    es = view.element_size()
    offsets = torch.tensor(view.storage_offset(), dtype=torch.long)
    for size, stride in zip(view.shape, view.stride()):
        offsets = offsets.unsqueeze(-1) + torch.arange(size) * stride
    offsets = offsets.flatten() * es
    return (view.untyped_storage().data_ptr() + offsets.unsqueeze(-1) + torch.arange(es)).flatten()


def layer_block_addresses(case: Case, group: int, block: int) -> torch.Tensor:
    parts = [byte_addresses(v) for name in case.group_layers(group) for v in case.block_views[name](block)]
    return torch.cat(parts)


def on_device(case: Case, device: str) -> Case:
    """The same layout, with every allocation copied to `device` and every view rebuilt over it."""
    raws = [raw.to(device, copy=True) for raw in case.raws]

    def move(view: torch.Tensor) -> torch.Tensor:
        for cpu_raw, raw in zip(case.raws, raws):
            offset = view.data_ptr() - cpu_raw.data_ptr()
            if 0 <= offset < cpu_raw.numel():
                size = view.element_size()
                return torch.as_strided(raw.view(view.dtype), view.shape, view.stride(), offset // size)
        raise ValueError("view outside the case's allocations")

    def moved_views(views: BlockViews) -> BlockViews:
        return lambda b: [move(v) for v in views(b)]

    kv_caches = {
        name: move(t) if isinstance(t, torch.Tensor) else [move(x) for x in t] for name, t in case.kv_caches.items()
    }
    return Case(
        name=f"{case.name}@{device}",
        kv_caches=kv_caches,
        config=case.config,
        raws=raws,
        block_views={name: moved_views(v) for name, v in case.block_views.items()},
    )
