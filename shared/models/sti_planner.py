"""Pipeline planning (STI §5): the largest submodel a latency target allows, then a bit width per shard so that
loading never stalls the compute.

*Compute planning* (§5.3) picks the shape (depth n, width m) with the most shards whose compute fits the
target, the deeper on a tie. *IO planning* (§5.4) gives each layer an accumulated IO budget (AIB): the IO
time available before that layer must start. Here the first layer's budget is the target's slack (what the
compute leaves of T), so a plan whose budgets stay non-negative finishes within T; each next layer's budget
adds one layer's compute. Loading a shard of layer k takes its IO time from the budgets of layer k and every
later one. A shard held in the preload buffer costs only its decoding. The first pass gives every other
shard one uniform bit width, the highest whose budgets hold; the second upgrades shards one at a time, in the
upgrade order (the shards by how far lowering each moves the model's output), to the highest version the budgets
still allow.

A shape whose cheapest uniform version would stall is not proposed: the paper still runs it and overruns T;
a server answers within the deadline instead, with a smaller submodel, or refuses at once.

The baselines of §7 are planned here too, from the same profile: Load&Exec (load the full-precision
submodel, then run it), StdPL-X (a layer pipeline at one bit width X), PreloadModel-X (the whole model held
at X bits: compute only).
"""

from __future__ import annotations

import bisect
import json
import time
from collections.abc import Callable, Sequence
from dataclasses import asdict, dataclass, field, replace
from typing import Any

from academus.shared.models.shards import FULL, VERSIONS

Shard = tuple[int, int]    # (layer, shard)


@dataclass(frozen=True)
class HardwareProfile:
    """What planning needs measured (§5.2): per shard and version, its load time through the IO source
    (read, checksum, decode) and its decoding alone (a preloaded shard); per width and length bucket, one
    layer's compute; per bucket, the rest of a run (its embedding rows, embeddings, pooling, head), and what
    setting up its loads costs the compute a layer, both timed inside runs through the IO source."""

    source: str
    load_ms: dict[int, float]
    decode_ms: dict[int, float]
    compute_ms: dict[int, dict[int, float]]     # width -> bucket -> ms
    overhead_ms: dict[int, float]               # bucket -> ms a run spends outside its layers and their loads
    buckets: tuple[int, ...]
    load_by_width: dict[int, dict[int, float]] = field(default_factory=dict)     # width -> version -> ms
    decode_by_width: dict[int, dict[int, float]] = field(default_factory=dict)
    finish_ms: dict[int, float] = field(default_factory=dict)   # bucket -> ms of it after the last layer
    layer_setup_ms: dict[int, dict[int, float]] = field(default_factory=dict)   # width -> bucket -> ms a layer

    def loads(self, width: int) -> tuple[dict[int, float], dict[int, float]]:
        """(load, decode) ms a shard per version, measured beside a layer of `width`: the loader shares the GIL
        with the compute, and a narrow layer takes it back more often (loads 10-25 % dearer beside 3 heads than
        beside 12). A profile measured beside one width only gives the same at every width."""
        return self.load_by_width.get(width, self.load_ms), self.decode_by_width.get(width, self.decode_ms)

    def bucket(self, length: int) -> int:
        i = bisect.bisect_left(self.buckets, length)
        return self.buckets[min(i, len(self.buckets) - 1)]

    def layer_ms(self, width: int, length: int) -> float:
        """One layer on `length` tokens (a batch's rows x longest): beyond the last bucket, in proportion."""
        return self.compute_ms[width][self.bucket(length)] * self._beyond(length)

    def rest_ms(self, length: int, depth: int = 0, width: int = 0) -> float:
        """A run's time outside its layers and their loads, for a plan of `depth` layers of `width` shards (0: its
        layers held)."""
        bucket = self.bucket(length)
        by_width = [self.layer_setup_ms[width]] if width in self.layer_setup_ms else self.layer_setup_ms.values()
        setup = max((by_bucket[bucket] for by_bucket in by_width), default=0.0)   # an unknown width: the dearest
        return (self.overhead_ms[bucket] + depth * setup) * self._beyond(length)

    def tail_ms(self, length: int) -> float:
        """What a run spends after its last layer (pooling, head)."""
        return self.finish_ms.get(self.bucket(length), self.overhead_ms[self.bucket(length)]) * self._beyond(length)

    def _beyond(self, length: int) -> float:
        return max(1.0, length / self.buckets[-1])

    def to_json(self) -> str:
        return json.dumps(asdict(self), indent=2, sort_keys=True)

    @classmethod
    def from_json(cls, raw: str) -> HardwareProfile:
        return cls.from_dict(json.loads(raw))

    @classmethod
    def from_dict(cls, d: dict[str, Any]) -> HardwareProfile:

        def by_width(table: dict[str, dict[str, float]]) -> dict[int, dict[int, float]]:
            return {int(w): {int(k): v for k, v in by.items()} for w, by in table.items()}

        return cls(d["source"], {int(k): v for k, v in d["load_ms"].items()},
                   {int(k): v for k, v in d["decode_ms"].items()}, by_width(d["compute_ms"]),
                   {int(k): v for k, v in d["overhead_ms"].items()}, tuple(d["buckets"]),
                   by_width(d.get("load_by_width", {})), by_width(d.get("decode_by_width", {})),
                   {int(k): v for k, v in d.get("finish_ms", {}).items()},
                   by_width(d.get("layer_setup_ms", {})))


@dataclass
class Plan:
    """A submodel and how it is loaded: each shard's version, which are preloaded, and the planned times."""

    arm: str
    depth: int
    width: int
    shards: list[list[int]]                       # per layer, its shards in load order
    bits: dict[Shard, int] = field(default_factory=dict)
    preload: set[Shard] = field(default_factory=set)
    feasible: bool = True
    overlap: bool = True                          # False: load everything, then compute (Load&Exec)
    io_ms: float = 0.0
    compute_ms: float = 0.0
    stall_ms: float = 0.0
    target_ms: float = 0.0
    plan_ms: float = 0.0
    buffer_bytes: int = 0                         # the preload buffer's stored bytes, upgraded shards included

    @property
    def mean_bits(self) -> float:
        return sum(self.bits.values()) / max(1, len(self.bits))

    def key(self) -> tuple:
        """What fixes the submodel's weights, hence its accuracy."""
        return self.depth, self.width, tuple(sorted(self.bits.items()))

    def truncated(self, depth: int) -> Plan:
        """Its first `depth` layers, at the same versions: what a run that stopped early computed (itself, for a run
        that was not cut: a worker asks on every batch)."""
        if depth == self.depth:
            return self
        kept = {x: b for x, b in self.bits.items() if x[0] < depth}
        return replace(self, depth=depth, shards=self.shards[:depth], bits=kept,
                       preload={x for x in self.preload if x[0] < depth})

    def summary(self) -> dict[str, Any]:
        hist: dict[str, int] = {}
        for b in self.bits.values():
            hist[str(b)] = hist.get(str(b), 0) + 1
        return {"arm": self.arm, "depth": self.depth, "width": self.width, "feasible": self.feasible,
                "mean_bits": round(self.mean_bits, 3), "bits": hist, "preload_shards": len(self.preload),
                "planned_io_ms": round(self.io_ms, 3), "planned_compute_ms": round(self.compute_ms, 3),
                "planned_stall_ms": round(self.stall_ms, 3), "target_ms": round(self.target_ms, 3),
                "plan_ms": round(self.plan_ms, 4)}


# A run may end this share past its target before the pace cuts it short: the bound issue 36 sets on STI's p95.
PACE_TOLERANCE = 0.10


@dataclass(frozen=True)
class Pace:
    """Where a run behind its plan stops early: before a layer that would end past the bound (the target and
    its tolerance), the run answers from the layers it has, with that shape's head, rather than overrun. A layer
    is expected to take the profile's time, or what this run's layers took so far where that is longer (beside
    the loader they run slower than profiled alone). Only at depths that have a head for the plan's width; a run
    on time is never cut."""

    bound_ms: float
    layer_ms: float       # one layer of the plan's shape, as profiled
    rest_ms: float        # pooling and head
    depths: frozenset[int]

    def stops_before(self, layer: int, elapsed_ms: float, layer_seen_ms: float = 0.0) -> bool:
        """`layer_seen_ms`: this run's mean layer so far (0: none yet)."""
        next_ms = max(self.layer_ms, layer_seen_ms)
        return layer in self.depths and elapsed_ms + next_ms + self.rest_ms > self.bound_ms


class Planner:
    """Plans for one task's shards on one profiled machine. `shard_bytes(layer, shard, bits)` sizes the preload;
    `layer_order(layer)` is the layer's shards, most important first; `importance` the order of the second pass's
    upgrades (a store's upgrade order: `TaskShards.upgrades`)."""

    def __init__(self, profile: HardwareProfile, depths: Sequence[int], widths: Sequence[int],
                 layer_order: Callable[[int], list[int]], importance: Sequence[Shard],
                 shard_bytes: Callable[[int, int, int], int], clock: Callable[[], float] = time.perf_counter,
                 min_bits: int = VERSIONS[0]) -> None:
        """`min_bits`: the lowest version a plan gives a shard (the task's fidelity floor: its whole model at
        fewer bits lost too much accuracy on the dev set); a shape that cannot afford it is not proposed."""
        self.profile = profile
        self.min_bits = min_bits
        self.versions = tuple(v for v in VERSIONS if v >= min_bits)
        self.shapes = sorted(((d, w) for d in depths for w in widths), key=lambda s: (-s[0] * s[1], -s[0]))
        self.layer_order, self.importance, self.shard_bytes = layer_order, list(importance), shard_bytes
        self.clock = clock

    # -- STI ------------------------------------------------------------------------------------------------

    def plan(self, target_ms: float, length: int, preload_bytes: int = 0,
             importance: Sequence[Shard] | None = None, arm: str = "sti",
             held: dict[Shard, int] | None = None) -> Plan:
        """The STI plan for a target; `feasible` False when no shape fits (the smallest is returned).
        `importance`: the order of the second pass's upgrades (default: the planner's; a width-m layer
        always runs its m most important shards, which its shape's head was fitted on). The preload buffer:
        `held` (shard -> the version a server holds), else the first shards of each candidate
        shape that fit `preload_bytes` (a buffer filled for this plan, as one cold run has it)."""
        started = self.clock()
        order = importance or self.importance
        for depth, width in self.shapes:
            shards = [self.layer_order(k)[:width] for k in range(depth)]
            buffer = self._preload(shards, preload_bytes) if held is None else held
            plan = self._io_plan(depth, width, shards, target_ms, length, buffer, order, arm)
            if plan is not None:
                plan.buffer_bytes = sum(self.shard_bytes(k, s, b) for (k, s), b in buffer.items())
                break
        else:
            plan = self._smallest(arm, length, target_ms, self.min_bits)
        plan.plan_ms = (self.clock() - started) * 1e3
        return plan

    def _io_plan(self, depth: int, width: int, shards: list[list[int]], target_ms: float, length: int,
                 held: dict[Shard, int], importance: Sequence[Shard], arm: str) -> Plan | None:
        layer_ms = self.profile.layer_ms(width, length)
        slack = target_ms - self.profile.rest_ms(length, depth, width) - depth * layer_ms
        if slack < 0:
            return None
        load, decode = self.profile.loads(width)
        budgets = Budgets(slack, layer_ms, depth)
        wanted = {(k, s) for k in range(depth) for s in shards[k]}
        bits = {x: b for x, b in held.items() if x in wanted and decode[b] < _cheapest_load(b, load)}
        for (k, _), b in bits.items():
            budgets.take(k, decode[b])
        free = [x for x in sorted(wanted) if x not in bits]
        uniform = None
        for b in self.versions:
            if budgets.would_hold({k: n * load[b] for k, n in _count(free).items()}):
                uniform = b
        if uniform is None:
            return None
        for k, n in _count(free).items():
            budgets.take(k, n * load[uniform])
        cost = {x: decode[b] for x, b in bits.items()} | dict.fromkeys(free, load[uniform])
        bits |= dict.fromkeys(free, uniform)
        for x in importance:                       # the second pass: upgrades, first in the order first
            if x not in wanted:
                continue
            for b in sorted((v for v in VERSIONS if v > bits[x]), reverse=True):
                if budgets.would_hold({x[0]: load[b] - cost[x]}):
                    budgets.take(x[0], load[b] - cost[x])
                    bits[x], cost[x] = b, load[b]
                    break
        preload = {x for x, b in held.items() if x in wanted and bits[x] == b}
        plan = Plan(arm, depth, width, shards, bits, preload, io_ms=sum(cost.values()), compute_ms=depth * layer_ms,
                    target_ms=target_ms)
        plan.stall_ms = simulate(plan, self.profile, length)["stall_ms"]
        return plan

    def _preload(self, shards: list[list[int]], preload_bytes: int) -> dict[Shard, int]:
        """The first shards in load order that fit the buffer, at the highest version (up to 6 bits) at
        which the first layer fits whole; shards of the bottom layers are needed first (§5.5)."""
        if preload_bytes <= 0:
            return {}
        quantized = [b for b in VERSIONS if b != FULL]
        fitting = [b for b in quantized if b >= self.min_bits
                   and sum(self.shard_bytes(0, s, b) for s in shards[0]) <= preload_bytes]
        bits = max(fitting) if fitting else max(self.min_bits, quantized[0])
        chosen, used = {}, 0
        for k, layer in enumerate(shards):
            for s in layer:
                size = self.shard_bytes(k, s, bits)
                if used + size > preload_bytes:
                    return chosen
                chosen[(k, s)] = bits
                used += size
        return chosen

    def held_for(self, preload_bytes: int) -> dict[Shard, int]:
        """What a server's preload buffer holds for every plan: the widest, deepest shape's first shards."""
        depth, width = max(self.shapes, key=lambda s: (s[1], s[0]))
        return self._preload([self.layer_order(k)[:width] for k in range(depth)], preload_bytes)

    def preload_bytes_of(self, plan: Plan) -> int:
        return sum(self.shard_bytes(k, s, plan.bits[(k, s)]) for k, s in plan.preload)

    def _smallest(self, arm: str, length: int, target_ms: float, bits: int, overlap: bool = True,
                  held: bool = False) -> Plan:
        """The smallest shape, for an arm no shape fits: it overruns the target (`feasible` False)."""
        return self._uniform(arm, *self.shapes[-1], bits, target_ms, length, overlap, held, feasible=False)

    def pace(self, plan: Plan, length: int) -> Pace:
        """When a run of `plan` behind its target stops early (`Pace`): at the depths with a head for its width."""
        return Pace(plan.target_ms * (1 + PACE_TOLERANCE), self.profile.layer_ms(plan.width, length),
                    self.profile.tail_ms(length), frozenset(d for d, w in self.shapes if w == plan.width))

    # -- baselines (§7.1) ------------------------------------------------------------------------------------

    def load_and_exec(self, target_ms: float, length: int) -> Plan:
        """Loads the full-precision submodel whole, then runs it: the shape whose load plus compute fits."""
        for depth, width in self.shapes:
            io = depth * width * self.profile.loads(width)[0][FULL]
            compute = depth * self.profile.layer_ms(width, length)
            if io + compute + self.profile.rest_ms(length, depth, width) <= target_ms:
                return self._uniform("load&exec", depth, width, FULL, target_ms, length, overlap=False)
        return self._smallest("load&exec", length, target_ms, FULL, overlap=False)

    def standard_pipeline(self, target_ms: float, length: int, bits: int) -> Plan:
        """StdPL-X: every shard at X bits, layer by layer, IO overlapping compute: the largest shape that
        does not stall past the target."""
        for depth, width in self.shapes:
            layer_ms = self.profile.layer_ms(width, length)
            slack = target_ms - self.profile.rest_ms(length, depth, width) - depth * layer_ms
            budgets = Budgets(slack, layer_ms, depth)
            layer_io = width * self.profile.loads(width)[0][bits]
            if slack >= 0 and budgets.would_hold(dict.fromkeys(range(depth), layer_io)):
                return self._uniform(f"stdpl-{bits}", depth, width, bits, target_ms, length)
        return self._smallest(f"stdpl-{bits}", length, target_ms, bits)

    def preload_model(self, target_ms: float, length: int, bits: int) -> Plan:
        """PreloadModel-X: the whole model in memory at X bits; the largest shape whose compute fits."""
        for depth, width in self.shapes:
            if depth * self.profile.layer_ms(width, length) + self.profile.rest_ms(length) <= target_ms:
                return self._uniform(f"preload-{bits}", depth, width, bits, target_ms, length, held=True)
        return self._smallest(f"preload-{bits}", length, target_ms, bits, held=True)

    def _uniform(self, arm: str, depth: int, width: int, bits: int, target_ms: float, length: int,
                 overlap: bool = True, held: bool = False, feasible: bool = True) -> Plan:
        """Every shard of the shape at `bits`; `held`: already in memory, decoded (no IO, no stall)."""
        shards = [self.layer_order(k)[:width] for k in range(depth)]
        bits_of = {(k, s): bits for k in range(depth) for s in shards[k]}
        plan = Plan(arm, depth, width, shards, bits_of, set(bits_of) if held else set(), feasible, overlap,
                    io_ms=0.0 if held else len(bits_of) * self.profile.loads(width)[0][bits],
                    compute_ms=depth * self.profile.layer_ms(width, length), target_ms=target_ms)
        if not held:
            plan.stall_ms = simulate(plan, self.profile, length)["stall_ms"]
        return plan


class Budgets:
    """Accumulated IO budgets: budget[k] = slack + k * layer_ms, less the IO of the shards of layers <= k."""

    def __init__(self, slack_ms: float, layer_ms: float, depth: int) -> None:
        self.budget = [slack_ms + k * layer_ms for k in range(depth)]

    def would_hold(self, cost_by_layer: dict[int, float]) -> bool:
        spent = 0.0
        for k in range(len(self.budget)):
            spent += cost_by_layer.get(k, 0.0)
            if self.budget[k] - spent < -1e-9:
                return False
        return True

    def take(self, layer: int, cost_ms: float) -> None:
        for k in range(layer, len(self.budget)):
            self.budget[k] -= cost_ms



def _cheapest_load(bits: int, load: dict[int, float]) -> float:
    """The cheapest load of a version at least as precise. A held shard is worth decoding only below it:
    through the page cache a full-precision read can cost less than decoding a held 6-bit shard, and
    counting the dearer decode made the planner pick narrower shapes with a buffer than without one."""
    return min(ms for b, ms in load.items() if b >= bits)


def _count(shards: Sequence[Shard]) -> dict[int, int]:
    counts: dict[int, int] = {}
    for k, _ in shards:
        counts[k] = counts.get(k, 0) + 1
    return counts


def simulate(plan: Plan, profile: HardwareProfile, length: int) -> dict[str, float]:
    """The plan's timeline if every load and layer took its profiled time: one loader in load order, the
    compute starting each layer when its shards are in. Returns finish and stall (compute waiting) in ms."""
    layer_ms = profile.layer_ms(plan.width, length)
    load, decode = profile.loads(plan.width)
    loaded, start, stall = 0.0, 0.0, 0.0
    ready = []
    for k, layer in enumerate(plan.shards):
        for s in layer:
            loaded += (decode if (k, s) in plan.preload else load)[plan.bits[(k, s)]]
        ready.append(loaded)
    if not plan.overlap:
        ready = [loaded] * len(ready)
    for k in range(plan.depth):
        begin = max(start, ready[k])
        stall += begin - start
        start = begin + layer_ms
    finish = start + profile.rest_ms(length, plan.depth, plan.width)
    return {"finish_ms": finish, "stall_ms": stall}
