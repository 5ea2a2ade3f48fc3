"""Before launch: the run's per-device memory (`plan_memory` of a `SizedRun`), the preflight
checks that list every configuration problem at once (`grid_checks`), what one sync moves
(`sync_traffic`). The run's resolution (`resolve_run`) is the config's: `runconfig.resolve`."""

from mcore_rl.planning.knobs import plan_with_suggestions
from mcore_rl.planning.memory import MemoryPlan, plan_memory
from mcore_rl.planning.sized import SizedRun, sized_run

__all__ = ["MemoryPlan", "SizedRun", "plan_memory", "plan_with_suggestions", "sized_run"]
