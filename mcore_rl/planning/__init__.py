"""Before launch: the run's resolution (`resolve_run`: device, layer spec, sync backend,
transports), its per-device memory (`plan_memory` of a `SizedRun`), and the preflight checks
that list every configuration problem at once (`preflight`)."""

from mcore_rl.planning.knobs import plan_with_suggestions
from mcore_rl.planning.memory import MemoryPlan, plan_memory
from mcore_rl.planning.sized import SizedRun, sized_run

__all__ = ["MemoryPlan", "SizedRun", "plan_memory", "plan_with_suggestions", "sized_run"]
