"""The tuning policy: what the operator may do and within which bounds (the CRD spec's pure twin).

The mode a policy actually runs in (`effective_mode`): a policy asks for one (spec.mode); the operator runs none above its
ceiling (`kvtune operator --max-mode`, the chart's `maxMode`), so turning on Apply is the cluster
administrator's decision and not whoever can write a policy; and a policy whose changes were undone
(`kvtune.dev/undo`) is held at Recommend until the annotation goes. Pure: values in, values out."""

from __future__ import annotations

from dataclasses import dataclass
from enum import Enum

from kvtune.core.whatif import DEFAULT_RISK_MARGIN
from kvtune.operator.decide.restart_budget import RestartBudget


class Mode(Enum):
    OBSERVE = "Observe"  # diagnose only
    RECOMMEND = "Recommend"  # diagnose and say what to change
    APPLY = "Apply"  # change it, where an actuator can


@dataclass(frozen=True)
class ScalingPolicy:
    """The replica signal's bounds: the autoscaler is told a count within them (it sets spec.replicas,
    never the operator), and NoPreemption's pick is called costly beyond `goodput_loss_warning`."""

    min_replicas: int = 1
    max_replicas: int = 16
    goodput_loss_warning: float = 0.25  # a NoPreemption pick losing more goodput than this share is said

    def __post_init__(self) -> None:
        if not 1 <= self.min_replicas <= self.max_replicas:
            raise ValueError("need 1 <= min_replicas <= max_replicas")
        if not 0 < self.goodput_loss_warning < 1:
            raise ValueError("goodput_loss_warning is a share of goodput, in (0, 1)")

    def clamp(self, replicas: int) -> int:
        return max(self.min_replicas, min(self.max_replicas, replicas))


@dataclass(frozen=True)
class Timing:
    """How long an action is watched before it is judged, and the least time between two actions."""

    evaluation_window_s: float
    cooldown_s: float


# A kvtune engine changes its knobs live: a minute of evidence judges a change, and the next may follow.
LIVE_TIMING = Timing(evaluation_window_s=60.0, cooldown_s=60.0)
# vLLM and SGLang change max_num_seqs by a rolling restart of every GPU pod, each reloading its model. The
# operator waits for that rollout before it judges (k8s.workload_watch), then judges on five minutes of the
# new pods, and makes at most one such change every half hour: a policy that states neither still does not
# restart the fleet as often as rollouts finish. A starting point, not a measured one.
RESTARTING_TIMING = Timing(evaluation_window_s=300.0, cooldown_s=1800.0)
RESTARTING_ENGINES = frozenset({"vllm", "sglang"})  # their max_num_seqs is a flag: a change restarts the pods


def default_timing(engine: str) -> Timing:
    """The evaluation window and cooldown a policy gets for `engine` when it states none."""
    return RESTARTING_TIMING if engine in RESTARTING_ENGINES else LIVE_TIMING


@dataclass(frozen=True)
class TuningPolicy:
    mode: Mode = Mode.RECOMMEND
    min_max_num_seqs: int = 1
    max_max_num_seqs: int = 1024
    cap_floor: int = 256  # the max_tokens cap never goes below this
    cap_margin: float = 1.25  # cap = generation p99 x margin
    # how long an action is watched before it is judged, and the least time between two actions
    evaluation_window_s: float = LIVE_TIMING.evaluation_window_s
    cooldown_s: float = LIVE_TIMING.cooldown_s
    max_step: int = 64  # largest change of max_num_seqs in one action
    allow_fp8: bool = False  # FP8 KV is applied only when this says so (accuracy caveat)
    shared_prefix_tokens: int = 0  # the workload declares a shared prefix this long (0: none declared)
    min_prefix_hit_rate: float = 0.3  # below this, with a declared shared prefix, the hash is defeated
    raise_kv_target: float = 0.8  # raise max_num_seqs only while projected KV usage stays under this
    throughput_tolerance: float = 0.1  # a saturated window losing more goodput than this rolls back
    unsafe_memory_s: float = 600.0  # how long a value that preempted blocks raising to it
    # the what-if model's move (kvtune.core.predict): on, the tuner fits the live workload and jumps to the
    # objective's pick before any measured step; off (the pure default, kept by the ladder's own tests),
    # measured stepping only. The CRD and `kvtune operator` turn it on.
    predict: bool = False
    objective: str = "NoPreemption"  # or Goodput, under p95_wait_bound_s
    p95_wait_bound_s: float | None = None
    round_to: int = 1  # max_num_seqs moves in multiples of this (8 for vLLM on CUDA: its CUDA graphs)
    # NoPreemption's pick keeps its predicted run within 1 - this of the pool, at least (more when the fit
    # is uncertain: kvtune.core.predict.Objective.for_fit)
    risk_margin: float = DEFAULT_RISK_MARGIN
    scaling: ScalingPolicy | None = None  # None: no replica signal (it costs a what-if search per window)
    restart_budget: RestartBudget | None = None  # None: restarting changes are bounded by the cooldown only

    def __post_init__(self) -> None:
        if not 1 <= self.min_max_num_seqs <= self.max_max_num_seqs:
            raise ValueError("need 1 <= min_max_num_seqs <= max_max_num_seqs")
        if self.cap_floor < 1 or self.cap_margin < 1.0 or self.max_step < 1:
            raise ValueError("cap_floor and max_step must be positive and cap_margin >= 1")
        if self.evaluation_window_s <= 0 or self.cooldown_s < 0:
            raise ValueError("evaluation_window_s must be positive and cooldown_s >= 0")
        if not 0 < self.raise_kv_target <= 1:
            raise ValueError("raise_kv_target must be in (0, 1]")
        if self.objective not in ("NoPreemption", "Goodput"):
            raise ValueError(f"objective must be NoPreemption or Goodput, got {self.objective!r}")
        if self.objective == "Goodput" and not (self.p95_wait_bound_s and self.p95_wait_bound_s > 0):
            raise ValueError("the Goodput objective needs a positive p95 latency bound")
        if self.round_to < 1 or not 0 <= self.risk_margin < 1:
            raise ValueError("round_to must be at least 1 and risk_margin in [0, 1)")

    def clamp(self, max_num_seqs: int) -> int:
        return max(self.min_max_num_seqs, min(self.max_max_num_seqs, max_num_seqs))


ORDER = (Mode.OBSERVE, Mode.RECOMMEND, Mode.APPLY)
UNDO_ANNOTATION = "kvtune.dev/undo"


@dataclass(frozen=True)
class ModeDecision:
    mode: Mode  # the mode the policy runs in
    capped: bool  # below what the policy asked for
    reason: str  # CamelCase, for the ModeCapped condition: MaxMode, UndoHold or AsRequested
    message: str


def effective_mode(requested: Mode, ceiling: Mode, undo_hold: bool = False) -> ModeDecision:
    """The lower of the policy's mode and the operator's ceiling; at most Recommend while an undo holds."""
    mode = min(requested, ceiling, key=ORDER.index)
    if undo_hold and ORDER.index(mode) > ORDER.index(Mode.RECOMMEND):
        return ModeDecision(
            Mode.RECOMMEND,
            True,
            "UndoHold",
            f"spec.mode is {requested.value}; held at Recommend while the {UNDO_ANNOTATION} annotation is "
            f"set (its changes were undone): remove the annotation to let it act again",
        )
    if mode is not requested:
        return ModeDecision(
            mode,
            True,
            "MaxMode",
            f"spec.mode is {requested.value}, but this operator runs no policy above {ceiling.value} (the "
            f"chart value maxMode, `kvtune operator --max-mode`): evaluated as {mode.value}",
        )
    return ModeDecision(mode, False, "AsRequested", f"runs as spec.mode asks: {mode.value}")
