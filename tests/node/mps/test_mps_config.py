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
