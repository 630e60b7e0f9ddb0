import pytest


@pytest.fixture(scope="module")
def env(tmp_path_factory) -> dict[str, str]:
    """The environment of a TorchTitan child job: offline, CPU mode, hermetic assets in this session's tmp dir,
    no fault injection inherited (a test adds its own). A module may define its own `env` instead."""
    from titan_integration import demo

    e = demo.child_env()
    e["TORCHMOE_TITAN_ASSETS"] = str(tmp_path_factory.mktemp("titan-assets"))
    e.pop("TORCHMOE_FAULT", None)
    return e
