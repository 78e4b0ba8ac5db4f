"""kubegpu's kube-scheduler profile, read the way each supported kube-scheduler release reads it: every node
that passes kube-scheduler's filters reaches the extender, the extender's scores alone order them, and the
filters all stay (shared/fixtures/kubegpu-on-v1.36/turn3-placement.md: with only that, a real v1.36.2
placed 600 of 600 pods on the simulator's node and GPUs; as rendered before, 5 %)."""

from __future__ import annotations

import numpy as np
import pytest

from kubegpu.install.render import scheduler_config
from kubegpu.install.values import MIN_KUBE, NEWEST_KUBE, Values
from kubegpu_standins.kube_scheduler_model import (
    ConfigRefused,
    NodeSearch,
    num_feasible_nodes_to_find,
    profile_model,
    select_host,
    total_scores,
)

RELEASES = [(MIN_KUBE[0], m) for m in range(MIN_KUBE[1], NEWEST_KUBE[1] + 1)]


def rendered(release: tuple[int, int]) -> dict:
    return scheduler_config(Values(kube_version=f"{release[0]}.{release[1]}"))


@pytest.mark.parametrize("release", RELEASES, ids=lambda r: f"{r[0]}.{r[1]}")
def test_every_release_sends_every_feasible_node_and_lets_the_extender_decide(release: tuple[int, int]) -> None:
    cfg = rendered(release)
    model = profile_model(cfg, release, "kubegpu-scheduler")  # what that release's strict decoding accepts
    for nodes in (50, 1213, 5000, 20_000):
        assert model.nodes_to_find(nodes) == nodes
    assert model.score_weights == {}  # no in-tree score can overturn the extender's pick
    (profile,) = cfg["profiles"]
    assert set(profile.get("plugins", {})) == {"score"}  # filters (taints, affinity, spread, resources) stay
    # The extender's pick gets 10, every other node at most 9: the pick has the highest total.
    ext = np.array([9, 10, 3, 9, 0])
    assert select_host(total_scores(model, {}, ext), np.random.default_rng(0)) == 1


def test_the_profile_percentage_is_rendered_only_where_the_release_has_the_field() -> None:
    for release in RELEASES:
        (profile,) = rendered(release)["profiles"]
        assert ("percentageOfNodesToScore" in profile) == (release >= (1, 27))
        assert rendered(release)["percentageOfNodesToScore"] == 100  # the global field, every API version
    cfg = rendered((1, 26))
    cfg["profiles"][0]["percentageOfNodesToScore"] = 100
    with pytest.raises(ConfigRefused, match="unknown field"):
        profile_model(cfg, (1, 26), "kubegpu-scheduler")
    with pytest.raises(ConfigRefused, match="not served"):
        profile_model(rendered((1, 24)), (1, 26), "kubegpu-scheduler")


def test_the_old_profile_reproduces_the_recorded_window() -> None:
    """As rendered before (no percentage, default score plugins): 497 of the 1,213 nodes reach the extender,
    as recorded; the in-tree scores (weights 1 and 1 for the two that vary) can outweigh the extender's
    pick (weight 5: 500 against 450 for a 9)."""
    cfg = rendered(NEWEST_KUBE)
    cfg.pop("percentageOfNodesToScore")
    cfg["profiles"] = [{"schedulerName": "kubegpu-scheduler"}]
    model = profile_model(cfg, (1, 36), "kubegpu-scheduler")
    assert model.nodes_to_find(1213) == 497 == num_feasible_nodes_to_find(0, 1213)
    assert num_feasible_nodes_to_find(0, 5000) == 500 and num_feasible_nodes_to_find(0, 150) == 100
    ext = np.array([10, 9])
    plugins = {"NodeResourcesFit": np.array([40, 100]), "NodeResourcesBalancedAllocation": np.array([60, 100])}
    assert select_host(total_scores(model, plugins, ext), np.random.default_rng(0)) == 1


def test_the_search_starts_where_the_last_one_stopped() -> None:
    search = NodeSearch(10)
    passes = np.array([True, False] * 5)
    assert search.feasible(passes, 2).tolist() == [0, 2]
    assert search.next_start == 3  # two found, one failed on the way
    assert search.feasible(passes, 2).tolist() == [4, 6]
    assert search.feasible(passes, 10).tolist() == [8, 0, 2, 4, 6]  # all processed: the start stays
    assert search.next_start == 7
