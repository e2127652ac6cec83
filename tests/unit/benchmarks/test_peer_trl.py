"""benchmarks/peer_trl.py's mapping of an async-rl config onto TRL's GRPOConfig arguments:
the learner's precision and checkpointing follow the config (TRL's own defaults would not)."""
from conftest import load_script

from async_rl.config import build_config

peer_trl = load_script("peer_trl")


def test_trl_follows_the_learners_precision_and_checkpointing(tmp_path):
    fp32 = peer_trl.trl_settings(build_config({}), tmp_path)
    assert fp32["bf16"] is False and fp32["gradient_checkpointing"] is False and fp32["use_cpu"] is True
    bf16 = peer_trl.trl_settings(build_config({"learner": {"precision": "bf16", "activation_checkpointing": True}}),
                                 tmp_path)
    assert bf16["bf16"] is True and bf16["gradient_checkpointing"] is True
    assert {k: v for k, v in bf16.items() if k not in ("bf16", "gradient_checkpointing")} == \
        {k: v for k, v in fp32.items() if k not in ("bf16", "gradient_checkpointing")}
