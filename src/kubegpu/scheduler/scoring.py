"""What the extender scores with: the learned target workload, its scoring context and the policy objects.

The extender and the simulator place through the same objects: one
:class:`~kubegpu.placement.policies.Policy` instance per policy name (each
carrying its own kept scores, keyed by generations), a
:class:`~kubegpu.placement.ScoreContext` per generation of the
:class:`~kubegpu.placement.workload.LearnedWorkload`, and ties broken by node
name (``node_rank``), which is the simulator's order for a name-sorted node list.
"""

from __future__ import annotations

import numpy as np

from kubegpu.placement import Policy, ScoreContext, get_policy
from kubegpu.placement.workload import LearnedWorkload, Workload


class Scoring:
    """The learned workload, the context built on it, and one instance of each policy in use."""

    def __init__(self, learner: LearnedWorkload | None = None) -> None:
        self.learner = learner or LearnedWorkload()
        self._ctx: ScoreContext | None = None
        self._ctx_gen = -1
        self._policies: dict[str, Policy] = {}

    def policy(self, name: str) -> Policy:
        pol = self._policies.get(name)
        if pol is None:
            pol = self._policies[name] = get_policy(name)
        return pol

    def context(self) -> ScoreContext:
        """The context for the current workload generation (a new one, with new kept tables, per rebuild)."""
        if self._ctx is None or self._ctx_gen != self.learner.generation:
            self._ctx = ScoreContext(workload=self.learner.current, rng=np.random.default_rng(0))
            self._ctx_gen = self.learner.generation
        return self._ctx

    @property
    def workload(self) -> Workload:
        return self.learner.current
