"""Before launch: the run's shape (`RunShape`), its per-device memory (`plan_memory`), and the
preflight checks that list every configuration problem at once (`preflight`)."""

from mcore_rl.planning.memory import MemoryPlan, plan_memory, plan_with_suggestions
from mcore_rl.planning.run_shape import RolloutShape, RunShape, TrainShape

__all__ = ["MemoryPlan", "RolloutShape", "RunShape", "TrainShape", "plan_memory",
           "plan_with_suggestions"]
