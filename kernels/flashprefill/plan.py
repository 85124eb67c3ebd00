"""Per-batch plan: request lengths on the host and the small device tensors every layer reuses.

Built once per forward batch (``flashprefill.make_plan``) and passed to every layer's call, so the
per-layer hot path reads no lengths back (the only ``.tolist()`` is here; the Triton index build
still syncs once, for ``nnz``). See ``docs/layout.md``.

Worked example (g = 4 query heads per KV head, tile_rows = 128, B = 128)::

    request  Lq    Lk    P=Lk-Lq  packed rows Lq*g  tiles ceil(rows/128)  blocks ceil(Lk/128)
      0      100   100     0          400               4                    1
      1     4096  8192  4096        16384             128                   64
      2        1    64    63            4               1                    1
    tile_ptr  = [0, 4, 132, 133]
    block_ptr = [0, 1, 65, 66]
    tile_request = [0,0,0,0, 1 x128, 2];  tile_local = [0,1,2,3, 0..127, 0]
"""
from __future__ import annotations

import itertools
from dataclasses import dataclass, field

import torch

TILE_ROWS = 128  # GQA-packed query rows per tile (``docs/method.md`` section 3.2)


@dataclass(frozen=True)
class BatchPlan:
    """Host-side lengths plus device-side tile/block maps of one varlen batch.

    Attributes:
        q_lens: new query tokens ``Lq`` per request (host ints).
        kv_lens: KV tokens ``Lk`` per request, prefix included (host ints).
        prefix_lens: ``P = Lk - Lq`` per request (host ints).
        q_starts: row offset of each request in the packed ``q`` (``cu_seqlens_q[:-1]``).
        group_size: ``g = Hq / Hkv``.
        block_size: key block size ``B`` in tokens.
        tile_rows: packed rows per query tile (128).
        tile_ptr: int32 ``[batch + 1]`` device; cumulative tiles per request.
        block_ptr: int32 ``[batch + 1]`` device; cumulative key blocks per request.
        tile_request: int32 ``[n_tiles]`` device; request of each tile.
        tile_local: int32 ``[n_tiles]`` device; tile number inside its request.
        n_tiles: tiles per KV head over the batch; segments = ``Hkv * n_tiles``.
        n_blocks: key blocks over the batch.
        derived: tensors a backend derives from the plan for every layer (e.g. the FP8 path's
            request of each key block, ``quant_kernels.block_requests``), made on the first layer's
            call and kept with the plan: ``(name, device) -> value``. Not an argument (a plan from
            ``dataclasses.replace`` starts empty), not compared.
    """

    q_lens: tuple[int, ...]
    kv_lens: tuple[int, ...]
    prefix_lens: tuple[int, ...]
    q_starts: tuple[int, ...]
    group_size: int
    block_size: int
    tile_rows: int
    tile_ptr: torch.Tensor
    block_ptr: torch.Tensor
    tile_request: torch.Tensor
    tile_local: torch.Tensor
    n_tiles: int
    n_blocks: int
    derived: dict = field(default_factory=dict, init=False, repr=False, compare=False)

    def derive(self, name: str, device, make):
        """``make()`` once per plan, ``name`` and device (``derived``); the value is shared by every
        later call, which must not write into it."""
        key = (name, str(torch.device(device)))
        if key not in self.derived:
            self.derived[key] = make()
        return self.derived[key]

    @property
    def batch(self) -> int:
        return len(self.q_lens)

    @property
    def max_q_len(self) -> int:
        return max(self.q_lens, default=0)

    @property
    def max_kv_len(self) -> int:
        return max(self.kv_lens, default=0)

    def max_blocks(self, block_size: int | None = None) -> int:
        """Key blocks of the longest request, ``ceil(max Lk / B)`` (0 for an empty batch), with
        ``B = block_size`` or the plan's own block size."""
        return -(-self.max_kv_len // (block_size or self.block_size))


def make_plan(
    seq_lens: torch.Tensor,
    cu_seqlens_q: torch.Tensor,
    group_size: int,
    block_size: int = 128,
    tile_rows: int = TILE_ROWS,
) -> BatchPlan:
    """Build the plan of a batch (one host sync).

    Args:
        seq_lens: int32 ``[batch]``, KV length per request including the new tokens.
        cu_seqlens_q: int32 ``[batch + 1]``, cumulative new-token counts.
        group_size: ``g = Hq / Hkv`` (>= 1).
        block_size: key block size ``B``.
        tile_rows: packed rows per query tile.

    Returns:
        ``BatchPlan``: host tuples ``q_lens``, ``kv_lens``, ``prefix_lens``, ``q_starts``; int32
        device tensors ``tile_ptr`` / ``block_ptr`` ``[batch + 1]`` and ``tile_request`` /
        ``tile_local`` ``[n_tiles]`` on ``seq_lens``' device; ``n_tiles``, ``n_blocks``.

    Raises:
        ValueError: if ``group_size``, ``block_size`` or ``tile_rows`` is not an int >= 1 (naming
            it), ``cu_seqlens_q`` is not ``[batch + 1]``, decreasing, or a request has
            ``q_len > seq_len`` (naming the request).
    """
    for name, value in (("group_size", group_size), ("block_size", block_size), ("tile_rows", tile_rows)):
        if isinstance(value, bool) or not isinstance(value, (int, torch.SymInt)) or value < 1:
            raise ValueError(f"make_plan: {name} must be an int >= 1, got {value!r}")
    if cu_seqlens_q.dim() != 1 or seq_lens.dim() != 1 or cu_seqlens_q.numel() != seq_lens.numel() + 1:
        raise ValueError(
            f"cu_seqlens_q must be [batch+1] = [{seq_lens.numel() + 1}] for seq_lens [batch] = "
            f"[{seq_lens.numel()}], got cu_seqlens_q {list(cu_seqlens_q.shape)}, seq_lens {list(seq_lens.shape)}"
        )
    cu = [int(x) for x in cu_seqlens_q.tolist()]
    kv = [int(x) for x in seq_lens.tolist()]
    if cu[0] != 0:
        raise ValueError(f"cu_seqlens_q[0] must be 0, got {cu[0]}")
    q_lens = []
    for b in range(len(kv)):
        lq = cu[b + 1] - cu[b]
        if lq < 0:
            raise ValueError(f"cu_seqlens_q must be non-decreasing, got {cu[b]} then {cu[b + 1]} at request {b}")
        if lq > kv[b]:
            raise ValueError(
                f"request {b}: q_len {lq} > seq_len {kv[b]} (seq_lens must include the new tokens)"
            )
        q_lens.append(lq)
    tiles = _tiles_per_request(q_lens, group_size, tile_rows)
    blocks = [-(-lk // block_size) for lk in kv]
    tile_ptr, block_ptr = [0], [0]
    for t, n in zip(tiles, blocks):
        tile_ptr.append(tile_ptr[-1] + t)
        block_ptr.append(block_ptr[-1] + n)
    dev = seq_lens.device
    tile_request = torch.repeat_interleave(torch.arange(len(tiles), dtype=torch.int32), torch.tensor(tiles, dtype=torch.int64))
    tile_local = torch.cat([torch.arange(t, dtype=torch.int32) for t in tiles]) if tiles else torch.zeros(0, dtype=torch.int32)
    return BatchPlan(
        q_lens=tuple(q_lens),
        kv_lens=tuple(kv),
        prefix_lens=tuple(k - q for k, q in zip(kv, q_lens)),
        q_starts=tuple(cu[:-1]),
        group_size=group_size,
        block_size=block_size,
        tile_rows=tile_rows,
        tile_ptr=torch.tensor(tile_ptr, dtype=torch.int32, device=dev),
        block_ptr=torch.tensor(block_ptr, dtype=torch.int32, device=dev),
        tile_request=tile_request.to(dev),
        tile_local=tile_local.to(dev),
        n_tiles=tile_ptr[-1],
        n_blocks=block_ptr[-1],
    )


def _tiles_per_request(q_lens, group_size: int, tile_rows: int) -> list[int]:
    """``ceil(Lq * g / R)`` GQA-packed query tiles of each request."""
    return [-(-lq * group_size // tile_rows) for lq in q_lens]


def host_tile_ptr(plan: BatchPlan) -> list[int]:
    """Cumulative GQA-packed tiles per request, host ints (``plan.tile_ptr`` without a copy)."""
    return [0, *itertools.accumulate(_tiles_per_request(plan.q_lens, plan.group_size, plan.tile_rows))]


def visible_blocks(plan: BatchPlan) -> list[int]:
    """Causally visible key blocks of each request, summed over its tiles (one KV head).

    Tile ``i`` of a request (packed rows ``[i*R, min((i+1)*R, Lq*g))``, last token ``t_last =
    (row_end - 1) // g``) sees blocks ``0 .. (P + t_last) // B`` (``docs/method.md`` section 3.2), so this
    is the sum of ``BlockIndex.n_visible`` over the request's segments of one KV head: the
    denominator of density, computed on the host from the lengths alone (no device read).
    """
    out = []
    g, R, B = plan.group_size, plan.tile_rows, plan.block_size
    for lq, p in zip(plan.q_lens, plan.prefix_lens):
        rows = lq * g
        n_tiles = -(-rows // R)
        if n_tiles == 0:
            out.append(0)
            continue
        row_end = torch.clamp(torch.arange(1, n_tiles + 1, dtype=torch.int64) * R, max=rows)
        out.append(int(((p + (row_end - 1) // g) // B + 1).sum()))
    return out
