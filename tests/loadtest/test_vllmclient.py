"""The vLLM-client side of ``loadtest engines`` without running vLLM: the arguments it gives
vLLM's own parser (which must accept them), and the table and goals built from result files."""

import importlib.util
from pathlib import Path

import pytest

from loadtest import vllmclient


def _res(tok8: float, ttft1: float) -> dict:
    return {"c=1": {"median_ttft_ms": ttft1, "output_throughput": 50.0, "completed": 4, "failed": 0},
            "c=8": {"median_ttft_ms": 90.0, "output_throughput": tok8, "completed": 8, "failed": 0}}


def test_goals_compare_the_best_vllm_fleet_and_the_e_p_d_ttft_with_vllm_serve():
    res = {"vllm-serve": _res(100.0, 20.0), "fleet:e-p-d,engine=vllm": _res(70.0, 36.0),
           "fleet:epd,engine=vllm": _res(85.0, 25.0)}
    lines = "\n".join(vllmclient.goals_md(res))
    assert "`fleet:epd,engine=vllm`" in lines and "85.0 / 100.0 = 0.85× — met" in lines
    assert "36.0 vs 20.0 ms (+16.0) — **not met**" in lines


def test_a_failed_level_is_shown_not_counted():
    res = {"vllm-serve": {"c=1": {"error": "vLLM's client exited 1"}, "c=8": _res(1, 1)["c=8"]},
           "fleet:e-p-d,engine=vllm": _res(70.0, 36.0)}
    table = "\n".join(vllmclient.table_md(res))
    assert "`vllm-serve`: vLLM's client exited 1" in table
    assert "TTFT p50 at c=1: not evaluated" in "\n".join(vllmclient.goals_md(res))


@pytest.mark.skipif(importlib.util.find_spec("vllm") is None, reason="vllm extra not installed")
def test_vllms_own_parser_takes_the_arguments(tmp_path):
    from vllm.benchmarks.serve import add_cli_args
    from vllm.utils.argparse_utils import FlexibleArgumentParser

    parser = FlexibleArgumentParser()
    add_cli_args(parser)
    args = parser.parse_args(vllmclient.client_argv("http://127.0.0.1:1", model="m", tokenizer=Path("/x"),
                                                    concurrency=8, num_prompts=32, result_dir=tmp_path,
                                                    result_file="r.json"))
    assert (args.dataset_name, args.max_concurrency, args.num_prompts) == ("random-mm", 8, 32)
    assert args.random_mm_bucket_config == {(224, 224, 1): 1.0} and args.ignore_eos
