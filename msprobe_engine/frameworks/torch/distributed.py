"""Merge partial-statistics rows across the ranks of a torch.distributed group: one policy for
every integration (DeepSpeed, Megatron-core, DDP/FSDP).

Two all-reduces per transfer, whose size does not depend on the world size: every rank packs
its rows (the same keys in the same order) into

- a float64 vector all-reduced with SUM: the sum-like columns (sum, sumsq, the counts; float64,
  so counts are exact), the first-rank sums and the replica check of each `AUTO` row, and
- an int64 vector all-reduced with MAX: the max columns and the negated min columns as
  order-preserving integer keys (`order_key`: nan sorts above +inf, so a nan anywhere comes
  out as nan, as `torch.amax` would), the layout checksum and the key count and their
  negations, and the per-rank scalars of `stats.ranks` with the rank in their low bits
  (max/argmax and min/argmin in one reduction).

Each row is combined as its policy says:

- `MERGE`: the ranks hold different pieces (shards, other data): the exact merge of
  `stats.columns` (min of mins, max of maxes, sums add);
- `ONCE`: the ranks hold copies (a replicated parameter): the first rank's row (the others
  contribute the identities -0.0 and the smallest key: x + -0.0 == x, exactly);
- `LOCAL`: rank-local data kept as it is (per-rank records): this rank's own row (not sent);
- `AUTO`: `ONCE` where every rank measured the very same bits, `MERGE` otherwise: the replica
  check is the row hash in pieces, weighted ``1 - size`` on the first rank and 1 on the others,
  whose exact sum is 0 where all copies agree (`_HashPieces`).

Nested groups (tensor then data parallel) merge in the same two all-reduces over the group of
all their ranks (`NestedMerge`): a rank gives a row where every group's policy lets it.

The layout (the maximum and minimum of the checksum and count agree) is checked with one small
host read the first time a layout is seen: ranks that measured different tensors fail loudly
instead of merging unrelated rows. No full tensor, and no rank's rows, is ever gathered.
"""
from __future__ import annotations

import zlib
from dataclasses import dataclass
from typing import TYPE_CHECKING, Callable, Sequence

import torch
import torch.distributed as dist

from msprobe_engine.stats import ranks as rank_stats
from msprobe_engine.stats.columns import P_INF, P_NAN, P_NUMEL, P_SUM, P_SUMSQ, merge_indices, n_columns
from msprobe_engine.stats.table import MetricKey

if TYPE_CHECKING:
    from msprobe_engine.incident.actions import StepDecision

MERGE, ONCE, LOCAL, AUTO = "merge", "once", "local", "auto"

Policy = Callable[[MetricKey], str]

_FLIP = (1 << 63) - 1
#: the smallest key: what a rank that contributes nothing to a maximum sends
NO_KEY = -(1 << 63)
_HASH_MASK = (1 << 62) - 1


def _signed(value: int) -> int:
    value &= (1 << 64) - 1
    return value - (1 << 64) if value >= 1 << 63 else value


#: odd multipliers of a row hash, one per column (and the finaliser's)
_MIX = [_signed((2 * i + 1) * 0x9E3779B97F4A7C15) for i in range(64)]
_FINAL = _signed(0xBF58476D1CE4E5B9)


def order_key(values: torch.Tensor) -> torch.Tensor:
    """int64 keys in the order of the float64 `values` (-0.0 below +0.0, every nan above +inf), so an
    integer MAX all-reduce is a float max that propagates nan; `from_key` undoes it."""
    values = torch.where(torch.isnan(values), float("nan"), values.to(torch.float64)).contiguous()
    bits = values.view(torch.int64)
    return torch.where(bits < 0, bits ^ _FLIP, bits)


def from_key(keys: torch.Tensor) -> torch.Tensor:
    """The float64 values of `order_key`'s keys."""
    return torch.where(keys < 0, keys ^ _FLIP, keys).contiguous().view(torch.float64)


def row_hash(rows: torch.Tensor) -> torch.Tensor:
    """One int64 in [0, 2**62) per row of a float64 ``[k, n]`` tensor, a function of every bit of the
    row (equal rows: equal hashes; different ones: different, but with probability ~2**-62)."""
    bits = rows.to(torch.float64).contiguous().view(torch.int64)
    mix = torch.tensor(_MIX[:bits.shape[1]], dtype=torch.int64, device=rows.device)
    h = (bits * mix).sum(dim=1)  # wraps modulo 2**64
    h = h ^ ((h >> 31) & ((1 << 33) - 1))
    h = h * _FINAL
    h = h ^ ((h >> 29) & ((1 << 35) - 1))
    return h & _HASH_MASK


@dataclass(frozen=True)
class _HashPieces:
    """`row_hash`es cut into `count` pieces of `bits` bits, as float64: small enough that a SUM over
    the ranks of one piece times the replica-check weights (the first copy's ``1 - size``, the
    others' 1) is exact, so it is 0 exactly where every group's copies hash alike."""
    bits: int
    count: int

    def __call__(self, hashes: torch.Tensor) -> torch.Tensor:
        low = (1 << self.bits) - 1
        return torch.stack([(hashes >> (self.bits * i)) & low for i in range(self.count)], dim=1).to(torch.float64)


def _hash_pieces(world: int) -> _HashPieces:
    """The pieces for `world` ranks: every partial sum stays below 2**53 (``2 * world * 2**bits``)."""
    bits = min(31, 52 - max(1, world.bit_length()))
    return _HashPieces(bits, -(-62 // bits))


@dataclass
class _Plan:
    """What a layout sends: the rows not kept `LOCAL` (`sent`), those this rank sends identities for
    (`idle`: a copy another rank gives), the `AUTO` ones (`auto`, positions in `sent`), those this
    rank gives no first-copy sums for (`auto_idle`) and the weight of its replica check
    (`auto_weight`), the rows of the per-rank scalars (replicated gradients `grads`, the loss
    `losses`); the column positions by merge."""
    sent: torch.Tensor
    idle: torch.Tensor | None
    auto: torch.Tensor | None
    auto_idle: torch.Tensor | None
    auto_weight: torch.Tensor | None
    grads: torch.Tensor
    losses: torch.Tensor
    sums: list[int]
    maxes: list[int]
    mins: list[int]


class GroupMerge:
    """Merges packed rows over one process group (`what` names it in errors: "data", "tensor").

    `parts`: the nested groups (inner first: tensor, then data parallel) whose product `group` is:
    a call then takes one policy per part and merges as one merge per part in turn would (a row's
    sums come from the ranks each part's policy lets give them), still in one pair of all-reduces
    over `group`; a row `LOCAL` over some parts only cannot be (`NestedMerge` merges part by part).
    After each call, `spread` holds the spread of the per-rank scalars (`stats.ranks`) over the
    group (and an `inner` group's), on the device (``[len(ranks.NAMES)]`` float64; ranks named by
    their global rank)."""

    def __init__(self, group: object = None, what: str = "data", parts: Sequence[object] | None = None) -> None:
        self.group = group
        self.what = what
        self.world = dist.get_world_size(group) if dist.is_initialized() else 1
        self.rank = dist.get_rank(group) if dist.is_initialized() else 0
        self.global_rank = dist.get_rank() if dist.is_initialized() else 0
        #: (this rank's rank, the size) in each part
        self.parts = [(self.rank, self.world)] if parts is None else [
            (dist.get_rank(part), dist.get_world_size(part)) for part in parts]
        world = dist.get_world_size() if dist.is_initialized() else 1
        self._rank_bits = (1 << max(1, (world - 1).bit_length())) - 1
        self._pieces = _hash_pieces(self.world)
        self._checked: set[int] = set()
        self._plans: dict[int, _Plan] = {}
        self.spread: torch.Tensor | None = None
        #: the spread's reduced pieces (its SUM part, its MAX keys) and how many ranks it covers: what
        #: a merge over the next group carries on (`inner`)
        self.reduced: tuple[torch.Tensor, torch.Tensor] | None = None
        self.spread_world = self.world

    def __call__(self, keys: Sequence[MetricKey], rows: torch.Tensor, policy: Policy | Sequence[Policy],
                 checksum: int | None = None, inner: "GroupMerge | None" = None) -> torch.Tensor:
        """`rows` merged over the group, row `i` as `policy(keys[i])` says (one policy per part, for
        a merge over `parts`). `inner`: the merge these rows just went through over another group
        (tensor parallel before data parallel): its spread is carried on, so `spread` covers both
        groups' ranks."""
        if self.world == 1:
            return rows
        checksum = layout_checksum(keys) if checksum is None else checksum
        policies = [policy] if callable(policy) else list(policy)
        plan = self._plan(checksum, keys, policies, rows.device)
        values = rows.to(torch.float64)
        carried = inner.reduced if inner is not None else None
        self.spread_world = self.world * (inner.spread_world if carried is not None else 1)
        sums, maxes = self._pack(plan, values, checksum, len(keys), carried)
        _all_reduce(sums, op=dist.ReduceOp.SUM, group=self.group)
        _all_reduce(maxes, op=dist.ReduceOp.MAX, group=self.group)
        layout = maxes[-(4 + 2 * len(rank_stats.SCALARS)):][:4]
        if checksum not in self._checked:
            if bool((layout[:2] != -layout[2:]).any()):
                raise RuntimeError(
                    f"msprobe: the ranks of the {self.what}-parallel group measured different tensors this "
                    "step (the module calls differ between ranks, e.g. data-dependent branches, or not every "
                    "rank reported a loss); their statistics cannot be merged. Every rank must run the same "
                    "modules and report alike; or watch fewer modules (config `modules`).")
            self._checked.add(checksum)
        return self._unpack(plan, values, sums, maxes).to(rows.dtype)

    def _pack(self, plan: _Plan, rows: torch.Tensor, checksum: int, count: int,
              carried: tuple[torch.Tensor, torch.Tensor] | None) -> tuple[torch.Tensor, torch.Tensor]:
        """(the SUM vector, the MAX vector) of this rank's rows (and of the spread `carried` on from
        an inner group's merge, else of this rank's scalars)."""
        part = rows[plan.sent]
        sums = part[:, plan.sums]
        maxes, mins = order_key(part[:, plan.maxes]), order_key(-part[:, plan.mins])
        if plan.idle is not None:  # copies another rank gives: the identities
            sums = torch.where(plan.idle[:, None], -0.0, sums)
            maxes = torch.where(plan.idle[:, None], NO_KEY, maxes)
            mins = torch.where(plan.idle[:, None], NO_KEY, mins)
        sum_parts, max_parts = [sums.flatten()], [maxes.flatten(), mins.flatten()]
        if plan.auto is not None:
            auto = part[plan.auto]
            first = auto[:, plan.sums]
            if plan.auto_idle is not None:
                first = torch.where(plan.auto_idle[:, None], -0.0, first)
            sum_parts += [first.flatten(), (self._pieces(row_hash(auto)) * plan.auto_weight[:, None]).flatten()]
        if carried is None:
            scalars = self._scalars(plan, rows)
            carried = (torch.cat([scalars, (scalars[:1] > 0).to(torch.float64)]),
                       torch.cat([self._with_rank(scalars), self._with_rank(-scalars)]))
        layout = torch.tensor([checksum, count, -checksum, -count], dtype=torch.int64, device=rows.device)
        return torch.cat(sum_parts + [carried[0]]), torch.cat(max_parts + [layout, carried[1]])

    def _unpack(self, plan: _Plan, rows: torch.Tensor, sums: torch.Tensor, maxes: torch.Tensor) -> torch.Tensor:
        """`rows` with the sent rows replaced by their merge; sets `spread`."""
        sent, s, mx, mn = len(plan.sent), len(plan.sums), len(plan.maxes), len(plan.mins)
        merged = torch.empty((sent, rows.shape[1]), dtype=torch.float64, device=rows.device)
        merged[:, plan.sums] = sums[:sent * s].view(sent, s)
        merged[:, plan.maxes] = from_key(maxes[:sent * mx]).view(sent, mx)
        merged[:, plan.mins] = -from_key(maxes[sent * mx:sent * (mx + mn)]).view(sent, mn)
        at_sum, at_max = sent * s, sent * (mx + mn)
        if plan.auto is not None:  # replicated in every group (each check sums to 0): the first copies' sums
            a, p = len(plan.auto), self._pieces.count
            first = sums[at_sum:at_sum + a * s].view(a, s)
            replicated = (sums[at_sum + a * s:at_sum + a * (s + p)].view(a, p) == 0).all(dim=1)
            sub = merged[plan.auto]
            sub[:, plan.sums] = torch.where(replicated[:, None], first, sub[:, plan.sums])
            merged[plan.auto] = sub
            at_sum += a * (s + p)
        self.reduced = (sums[at_sum:], maxes[at_max + 4:])
        self.spread = self._spread(*self.reduced)
        out = rows.clone()
        out[plan.sent] = merged
        return out

    def _scalars(self, plan: _Plan, rows: torch.Tensor) -> torch.Tensor:
        """This rank's `stats.ranks.SCALARS` (before the merge)."""
        nonfinite = (rows[:, P_NAN] + rows[:, P_INF]).sum()
        grad_norm = rows[plan.grads, P_SUMSQ].sum().sqrt()
        numel = rows[plan.losses, P_NUMEL].sum()
        loss = torch.where(numel > 0, rows[plan.losses, P_SUM].sum() / numel.clamp(min=1), 0.0)
        return torch.stack([nonfinite, grad_norm, loss])

    def _with_rank(self, scalars: torch.Tensor) -> torch.Tensor:
        """Keys of `scalars` with this rank in the low bits (the lowest rank wins a tie)."""
        low = self._rank_bits
        return (order_key(scalars) & ~low) | (low - self.global_rank)

    def _spread(self, sums: torch.Tensor, maxes: torch.Tensor) -> torch.Tensor:
        n, low = len(rank_stats.SCALARS), self._rank_bits
        high, neg = maxes[:n], maxes[n:2 * n]
        parts = torch.stack([from_key(high & ~low), (low - (high & low)).to(torch.float64),
                             -from_key(neg & ~low), (low - (neg & low)).to(torch.float64), sums[:n]], dim=1)
        world = torch.full((1,), float(self.spread_world), dtype=torch.float64, device=sums.device)
        return torch.cat([world, parts.flatten(), sums[n:n + 1]])

    def _plan(self, checksum: int, keys: Sequence[MetricKey], policies: Sequence[Policy],
              device: torch.device) -> _Plan:
        """What a layout sends, built once per layout."""
        plan = self._plans.get(checksum)
        if plan is None:
            kinds = [tuple(policy(key) for policy in policies) for key in keys]
            sent = [i for i, k in enumerate(kinds) if set(k) != {LOCAL}]
            if any(LOCAL in kinds[i] or AUTO in kinds[i][1:] for i in sent):
                raise ValueError("GroupMerge: over several parts, a row is LOCAL over all of them or none, and "
                                 "AUTO over the first only")
            gives = [all(kind != ONCE or rank == 0 for kind, (rank, _) in zip(kinds[i], self.parts)) for i in sent]
            auto = [j for j, i in enumerate(sent) if kinds[i][0] == AUTO]
            first_rank, first_size = self.parts[0]
            weight = float(1 - first_size if first_rank == 0 else 1)  # the first copy minus the others

            def index(positions: list[int]) -> torch.Tensor:
                return torch.tensor(positions, dtype=torch.long, device=device)

            def mask(flags: list[bool]) -> torch.Tensor | None:
                return torch.tensor(flags, device=device) if any(flags) else None

            plan = self._plans[checksum] = _Plan(
                index(sent), mask([not g for g in gives]), index(auto) if auto else None,
                mask([not gives[j] or first_rank != 0 for j in auto]),
                torch.tensor([weight if gives[j] else 0.0 for j in auto], dtype=torch.float64, device=device),
                index([i for i, k in enumerate(keys) if k.kind == "grad" and kinds[i][0] == ONCE]),
                index([i for i, k in enumerate(keys) if k.kind == "train" and k.path == "loss"]),
                merge_indices("sum"), merge_indices("max"), merge_indices("min"))
        return plan

    def spread_rows(self) -> torch.Tensor | None:
        """`spread` as rows of one number each (`stats.ranks.KIND` rows, `ranks.NAMES` order)."""
        if self.spread is None:
            return None
        rows = torch.zeros((len(self.spread), n_columns()), dtype=torch.float64, device=self.spread.device)
        rows[:, P_SUM] = self.spread
        rows[:, P_NUMEL] = 1.0
        return rows


class NestedMerge:
    """Rows merged over nested process groups (`parts`: (group, name, policy), inner first: tensor,
    then data parallel; or expert data, then expert parallel), as one `GroupMerge` per part in turn
    would merge them: in one pair of all-reduces over `stage`, the group of all their ranks, where
    every row allows it (none `LOCAL` over some parts only, none `AUTO` but over the first); else,
    and without a `stage`, part by part (a pair per part). Parts of one rank are left out."""

    def __init__(self, parts: Sequence[tuple[object, str, Policy]], stage: object = None) -> None:
        parts = [part for part in parts if dist.get_world_size(part[0]) > 1]
        self.policies = [policy for _, _, policy in parts]
        self.chain = [GroupMerge(group, what) for group, what, _ in parts]
        self.whole: GroupMerge | None = self.chain[0] if len(parts) == 1 else None
        groups = [group for group, _, _ in parts]
        if len(parts) > 1 and stage is not None and _product_of(stage, groups):
            self.whole = GroupMerge(stage, " x ".join(what for _, what, _ in parts), groups)
        self._whole_fits: dict[int, bool] = {}
        self.last: GroupMerge | None = None  # the merge of the last call (its spread covers every part)

    def __call__(self, keys: Sequence[MetricKey], rows: torch.Tensor, checksum: int | None = None) -> torch.Tensor:
        """`rows` merged over every part, as the parts' policies say."""
        checksum = layout_checksum(keys) if checksum is None else checksum
        if self.whole is not None and self._fits(checksum, keys):
            self.last = self.whole
            return self.whole(keys, rows, self.policies, checksum)
        return self.by_group(keys, rows, checksum)

    def by_group(self, keys: Sequence[MetricKey], rows: torch.Tensor, checksum: int,
                 first: Callable[..., torch.Tensor] | None = None) -> torch.Tensor:
        """`rows` merged part by part (a pair of all-reduces each); `first` in place of the first
        part's merge (one that watches it: `megatron.tp_split`)."""
        inner = None
        for at, (merge, policy) in enumerate(zip(self.chain, self.policies)):
            merge = first if at == 0 and first is not None else merge
            rows, inner = merge(keys, rows, policy, checksum, inner=inner), merge
        self.last = inner
        return rows

    def spread_rows(self) -> torch.Tensor | None:
        """The last call's spread over every part's ranks (`GroupMerge.spread_rows`)."""
        return self.last.spread_rows() if self.last is not None else None

    def _fits(self, checksum: int, keys: Sequence[MetricKey]) -> bool:
        """Whether `whole` can merge this layout: no row `LOCAL` over some parts only, none `AUTO`
        over a part other than the first (tensor, then context parallel; once per layout)."""
        if checksum not in self._whole_fits:
            kinds = (tuple(policy(key) for policy in self.policies) for key in keys)
            self._whole_fits[checksum] = len(self.policies) == 1 or all(
                (len(set(k)) == 1 or LOCAL not in k) and AUTO not in k[1:] for k in kinds)
        return self._whole_fits[checksum]


def _product_of(stage: object, parts: Sequence[object]) -> bool:
    """Whether `stage` holds this rank's groups `parts` and as many ranks as their product (a grid)."""
    members = set(dist.get_process_group_ranks(stage or dist.group.WORLD))
    size = 1
    for part in parts:
        size *= dist.get_world_size(part)
        if not members >= set(dist.get_process_group_ranks(part or dist.group.WORLD)):
            return False
    return size == len(members)


def agree(decision: "StepDecision", group: object, device: torch.device) -> "StepDecision":
    """A skip/stop decision taken on rank-local rows (`per_rank`), made the same on every rank of
    `group`: one all-reduce (MAX) of (skip, stop), so any rank's skip or stop applies to all
    (`StepDecision.joined`). Call it on every rank of the group; a reducer's `agree` (called by
    `Monitor.before_optimizer_step`)."""
    return decision.joined(*agree_flags(decision.skip, decision.stop, group, device))


def agree_flags(skip: bool, stop: bool, group: object = None, device: torch.device | str = "cpu") -> tuple[bool, bool]:
    """The collective skip/stop decision: one all-reduce (MAX) of the two flags over `group`
    (None: the default group), so every rank takes the most cautious one; (skip, stop)."""
    flags = torch.tensor([float(skip or stop), float(stop)], device=device)
    dist.all_reduce(flags, op=dist.ReduceOp.MAX, group=group)
    skip, stop = (bool(f) for f in flags.tolist())
    return skip, stop


def layout_checksum(keys: Sequence[MetricKey]) -> int:
    """A checksum of a key list that is the same in every process (unlike `hash`): ranks
    send it along with their rows to prove they measured the same tensors in the same order."""
    return zlib.crc32("\n".join("\t".join(k) for k in keys).encode())


def gather_rows(rows: torch.Tensor, group: object = None) -> torch.Tensor:
    """All-gather every rank's ``[k, n]`` rows into ``[world, k, n]`` (one collective; the replica
    check's hashes, not the statistics merge)."""
    world = dist.get_world_size(group)
    gathered = torch.empty((world * rows.shape[0], rows.shape[1]), dtype=rows.dtype, device=rows.device)
    _all_gather(gathered, rows.contiguous(), group=group)
    return gathered.view(world, *rows.shape)


#: the merge's collective (a name of its own, so that a test or a benchmark can count its calls)
_all_reduce = dist.all_reduce
# torch 2.13 renamed all_gather_into_tensor; keep working on both sides of the rename.
_all_gather = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor
