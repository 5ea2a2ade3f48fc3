"""A sync plan crosses the wire once per sync group, not once per sync.

The plan is fixed for a run (the two layouts do not change); pickling it into every call —
to every actor rank, every engine and, through vLLM's RPC, every engine worker — would make
every receiver unpickle it and recompute its fingerprint at each sync, and a large model's
plan is big. So the controller sends the whole plan the first time after a sync group forms
(every member may be new: an engine restart re-forms the group) and a `PlanRef` — its
fingerprint — afterwards; each receiver keeps the plans it got in a small `PlanCache` and
resolves the reference. A reference to a plan a receiver never got is an error naming the
fingerprint, never a silent mismatch. Every rank's fingerprint is compared (`verify_plan`)
before the first byte of a plan moves in a group; a plan the group's ranks already agreed on
is not compared again (`SyncChannels.verify`).
"""

from __future__ import annotations

from collections import OrderedDict
from dataclasses import dataclass

from mcore_rl.resharding.planner import Plan


@dataclass(frozen=True)
class PlanRef:
    """A plan the receiver already holds, by fingerprint."""

    fingerprint: bytes

    def __str__(self) -> str:
        return f"plan {self.fingerprint.hex()[:12]}"


class PlanCache:
    """The plans one receiver has been sent, newest kept (a run has one; a few fit)."""

    def __init__(self, size: int = 4):
        self.size = size
        self._plans: OrderedDict[bytes, Plan] = OrderedDict()

    def resolve(self, plan: Plan | PlanRef) -> Plan:
        """The plan itself (a Plan is kept for later references)."""
        if isinstance(plan, PlanRef):
            if plan.fingerprint not in self._plans:
                raise KeyError(f"{plan} was never sent to this rank (sent: "
                               f"{[f.hex()[:12] for f in self._plans] or 'none'}); the sender "
                               "must send the whole plan to a rank that joined a new sync group")
            self._plans.move_to_end(plan.fingerprint)
            return self._plans[plan.fingerprint]
        self._plans[plan.fingerprint()] = plan
        self._plans.move_to_end(plan.fingerprint())
        while len(self._plans) > self.size:
            self._plans.popitem(last=False)
        return plan


class PlanSender:
    """The sender's side: the whole plan until every receiver has it, then its reference.
    `joined()` when the receivers change (a sync group formed); `delivered()` after a sync
    that every receiver completed."""

    def __init__(self, plan: Plan):
        self.plan, self._ref, self._everyone_has_it = plan, PlanRef(plan.fingerprint()), False

    def joined(self) -> None:
        self._everyone_has_it = False

    def delivered(self) -> None:
        self._everyone_has_it = True

    def payload(self) -> Plan | PlanRef:
        return self._ref if self._everyone_has_it else self.plan


__all__ = ["PlanCache", "PlanRef", "PlanSender"]
