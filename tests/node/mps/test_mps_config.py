"""One setting selects share enforcement: file, environment or flag, as every other node setting."""

from __future__ import annotations

import pytest

from kubegpu.node.config import ConfigError, load_config


def test_share_enforcement_from_file_env_and_flag() -> None:
    assert load_config().kubegpu.share_enforcement == "none"
    assert load_config(file={"kubegpu": {"shareEnforcement": "mps"}}).kubegpu.share_enforcement == "mps"
    assert load_config(env={"KUBEGPU_SHARE_ENFORCEMENT": "mps"}).kubegpu.share_enforcement == "mps"
    flagged = load_config(flags={"share-enforcement": "none"}, env={"KUBEGPU_SHARE_ENFORCEMENT": "mps"})
    assert flagged.kubegpu.share_enforcement == "none"
    with pytest.raises(ConfigError, match=r"share-enforcement.*none, mps"):
        load_config(flags={"share-enforcement": "hami"})


@pytest.mark.parametrize(("given", "selected"), [("strict", "strict"), ("per-shape", "mps"), ("mps", "mps"),
                                                  ("none", "none")])
def test_the_enforcement_modes_are_named_and_per_shape_is_mps(given: str, selected: str) -> None:
    assert load_config(flags={"share-enforcement": given}).kubegpu.share_enforcement == selected
    assert load_config(file={"kubegpu": {"shareEnforcement": given}}).kubegpu.share_enforcement == selected


def test_an_unknown_mode_is_refused_naming_every_mode() -> None:
    with pytest.raises(ConfigError, match=r"--share-enforcement: 'exclusive' is not one of none, mps, per-shape, "
                                          r"strict"):
        load_config(flags={"share-enforcement": "exclusive"})
    with pytest.raises(ConfigError, match=r"kubegpu.shareEnforcement"):
        load_config(file={"kubegpu": {"shareEnforcement": "Strict"}})


def test_the_strict_server_user_from_file_env_and_flag() -> None:
    assert load_config().kubegpu.mps_server_uid == 0
    assert load_config(file={"kubegpu": {"mpsServerUid": 1000}}).kubegpu.mps_server_uid == 1000
    assert load_config(env={"KUBEGPU_MPS_SERVER_UID": "65534"}).kubegpu.mps_server_uid == 65534
    with pytest.raises(ConfigError, match="mps-server-uid"):
        load_config(flags={"mps-server-uid": "-1"})
