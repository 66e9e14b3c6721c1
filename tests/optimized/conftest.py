import pytest


@pytest.fixture
def verify_argv(tiny_dirs, tmp_path):
    """`dblock verify` on the tiny llada2_moe checkpoint over three fixed prompts: the argv before any flag under
    test."""
    p = tmp_path / "p.txt"
    p.write_text("5,6,7,8,9,10,11\n3,4,5\n12,13,14,15,16,17,18,19,20\n")
    return ["verify", "--model", tiny_dirs["llada2_moe"], "--prompts", str(p)]
