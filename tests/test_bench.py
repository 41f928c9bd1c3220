"""``mtplx bench`` end to end on a tiny fixture checkpoint, and its statistics helpers on
fixed numbers."""

from __future__ import annotations

import json
import math
from pathlib import Path

import pytest

from mtplx.bench.stats import (
    acceptance_per_position,
    median,
    paired_speedups,
    pooled_acceptance_length,
    spread,
)
from tests.fixtures.checkpoints import build_checkpoint
from tests.fixtures.variants import untie_lm_head


def test_median_and_spread() -> None:
    assert median([3.0, 1.0, 2.0]) == 2.0
    assert median([4.0, 1.0, 2.0, 3.0]) == 2.5
    assert math.isnan(median([]))
    s = spread([5.0, 1.0, 3.0, 2.0, 4.0])
    assert (s.median, s.low, s.high, s.q1, s.q3, s.count) == (3.0, 1.0, 5.0, 2.0, 4.0, 5)
    one = spread([7.0])
    assert (one.median, one.q1, one.q3) == (7.0, 7.0, 7.0)
    assert spread([]).count == 0


def _rec(mode: str, prompt: str, repeat: int, tps: float, category: str = "chat") -> dict:
    return {
        "mode": mode,
        "sampler": "greedy",
        "category": category,
        "prompt_id": prompt,
        "repeat": repeat,
        "decode_tps": tps,
    }


def test_speedups_pair_within_prompt_and_repeat() -> None:
    records = [
        _rec("plain", "a", 0, 10.0),
        _rec("ngram", "a", 0, 20.0),
        _rec("plain", "a", 1, 5.0),  # a slower repeat: the ratio, not the raw speed, counts
        _rec("ngram", "a", 1, 6.0),
        _rec("plain", "b", 0, 8.0, "code"),
        _rec("ngram", "b", 0, 4.0, "code"),
        _rec("ngram", "c", 0, 99.0),  # no plain partner: left out
    ]
    ratios = paired_speedups(records)
    assert ratios[("greedy", "chat", "ngram")] == pytest.approx([2.0, 1.2])
    assert ratios[("greedy", "chat", "plain")] == [1.0, 1.0]
    assert ratios[("greedy", "code", "ngram")] == [0.5]
    # Median of the paired ratios (1.6), not the ratio of median speeds (13 / 7.5).
    assert median(ratios[("greedy", "chat", "ngram")]) == pytest.approx(1.6)


def test_acceptance_pooling() -> None:
    assert acceptance_per_position([[2, 1], [1, 0, 0]], [[2, 2], [2, 2, 1]]) == [
        0.75,
        0.25,
        0.0,
    ]
    assert pooled_acceptance_length([3, 1], [2, 2]) == 2.0
    assert math.isnan(pooled_acceptance_length([], []))


def test_mlxlm_cycle_counting() -> None:
    from mtplx.bench.backends import RunResult, _count_cycles

    result = RunResult(tokens=7, ttft=0.0, decode_time=1.0)
    # cycles: [d d t] [t] [d d d t]  with k = 3
    flags = [True, True, False, False, True, True, True, False]
    _count_cycles(result, flags, 3)
    assert result.num_cycles == 3
    assert result.num_accepted == 5
    assert result.accepted_per_position == [2, 2, 1]
    assert result.drafted_per_position == [3, 3, 3]
    assert result.mean_acceptance_length == pytest.approx(8 / 3)


@pytest.fixture(scope="module")
def fixture_model(tmp_path_factory: pytest.TempPathFactory) -> Path:
    directory = tmp_path_factory.mktemp("bench") / "llama_mtp"
    build_checkpoint("llama_mtp", directory)
    untie_lm_head(directory)
    return directory


def test_bench_end_to_end(fixture_model: Path, tmp_path: Path) -> None:
    from mtplx.cli import main

    prompts = tmp_path / "prompts"
    prompts.mkdir()
    (prompts / "chat.jsonl").write_text('{"id": "c1", "prompt": "hello there"}\n')
    (prompts / "repeat.txt").write_text("abc abc abc abc\nxyz\n")
    out = tmp_path / "out"
    argv = [
        "bench",
        str(fixture_model),
        "--max-tokens", "6",
        "--repeats", "2",
        "--prompt-dir", str(prompts),
        "--prompts-per-category", "1",
        "--mtp-depths", "2",
        "--draft-depth", "2",
        "--out", str(out),
        "--no-progress",
    ]  # fmt: skip
    assert main(argv) == 0
    data = json.loads((out / "results.json").read_text())
    modes = [m["name"] for m in data["modes"]]
    assert modes == [
        "plain", "default", "mtp@1", "mtp@2", "draft@2", "ngram@4", "mlxlm-plain", "mlxlm-spec@2"
    ]  # fmt: skip
    assert data["draft_layers"] == 1
    # 2 repeats x 2 samplers x 2 prompts x 8 modes, every one decoding max_tokens.
    assert len(data["records"]) == 64
    assert {r["tokens"] for r in data["records"]} == {6}
    for field in ("decode_tps", "ttft_s", "mean_acceptance_length", "peak_memory_mb"):
        assert all(field in r for r in data["records"])
    rows = {(r["sampler"], r["category"], r["mode"]): r for r in data["summary"]}
    assert rows[("greedy", "chat", "plain")]["speedup"]["median"] == 1.0
    assert rows[("greedy", "all", "mtp@2")]["speedup"]["n"] == 4
    # Exactness at T=0: every decoder (ours speculative, mlx-lm's) emits plain's tokens.
    for (sampler, _, _), row in rows.items():
        if sampler == "greedy":
            assert row["same_tokens_as_plain"] == 1.0, row["mode"]
    spec = rows[("t0.6", "all", "mlxlm-spec@2")]
    assert spec["mean_acceptance_length"] >= 1.0
    assert len(spec["acceptance_per_position"]) == 2
    assert data["machine"]["blas"]["name"]
    assert any(b["bar"].startswith("mtp vs plain") for b in data["bars"])
    md = (out / "results.md").read_text()
    assert "| category | mode | decode tok/s | speedup" in md
    assert "mlxlm-spec@2" in md and "## Bars" in md
    assert (out / "speedup.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    assert len((out / "records.jsonl").read_text().splitlines()) == 64


class FakeLlama:
    """What run_llamacpp uses of llama_cpp.Llama: set_seed and an endless generate."""

    def __init__(self) -> None:
        self.seed: int | None = None
        self.kwargs: dict[str, object] = {}

    def set_seed(self, seed: int) -> None:
        self.seed = seed

    def generate(self, tokens: list[int], **kwargs: object):
        self.kwargs = {"tokens": list(tokens), **kwargs}
        token = 0
        while True:  # like llama.cpp's: never stops on its own, EOS included
            token += 1
            yield token


def test_llamacpp_run_decodes_max_tokens_with_our_sampler() -> None:
    from mtplx.bench.backends import run_llamacpp
    from mtplx.request import SamplerConfig

    llm = FakeLlama()
    sampler = SamplerConfig(temperature=0.6, top_p=0.95, top_k=20, seed=7)
    result = run_llamacpp(llm, [5, 6, 7], sampler, max_tokens=5)
    assert result.token_ids == [1, 2, 3, 4, 5]
    assert result.tokens == 5 and result.decode_time >= 0.0 and result.ttft >= 0.0
    assert result.peak_memory_mb is None  # MLX's peak says nothing of llama.cpp's memory
    assert llm.seed == 7
    assert llm.kwargs == {
        "tokens": [5, 6, 7], "temp": 0.6, "top_p": 0.95, "top_k": 20, "min_p": 0.0,
        "repeat_penalty": 1.0, "reset": True,
    }  # fmt: skip
    greedy = run_llamacpp(llm, [5], SamplerConfig(temperature=0.0), max_tokens=1)
    assert greedy.token_ids == [1] and llm.kwargs["temp"] == 0.0


def test_llamacpp_models_come_from_the_source_gguf(tmp_path: Path, monkeypatch) -> None:
    import gguf

    from mtplx.bench import runner
    from tests.test_gguf import write_tiny_gguf

    native = tmp_path / "tiny.gguf"
    write_tiny_gguf(native)
    model_dir = tmp_path / "models" / "tiny"
    model_dir.mkdir(parents=True)
    config = runner.BenchConfig(model=str(model_dir))
    real_find_spec = runner.importlib.util.find_spec
    monkeypatch.setattr(
        runner.importlib.util,
        "find_spec",
        lambda name: object() if name == "llama_cpp" else real_find_spec(name),
    )
    assert runner.llamacpp_ggufs(config) == {}  # no GGUF source known
    (model_dir / "mtplx_source.json").write_text(json.dumps({"gguf": str(native)}))
    ggufs = runner.llamacpp_ggufs(config)
    assert ggufs == {"native": native, "f32": tmp_path / "models" / "tiny.f32.gguf"}
    tensors = gguf.GGUFReader(str(ggufs["f32"])).tensors
    assert {t.tensor_type for t in tensors} == {gguf.GGMLQuantizationType.F32}
    written = ggufs["f32"].stat().st_mtime_ns
    assert runner.llamacpp_ggufs(config) == ggufs and ggufs["f32"].stat().st_mtime_ns == written
    monkeypatch.setattr(runner.importlib.util, "find_spec", lambda name: None)
    assert runner.llamacpp_ggufs(config) == {}  # llama-cpp-python not installed


def test_llamacpp_modes_follow_the_available_models(fixture_model: Path) -> None:
    from mtplx.bench.runner import BenchConfig, expand_modes
    from mtplx.engine import Engine
    from mtplx.models import load

    engine = Engine(load(str(fixture_model)))
    config = BenchConfig(model=str(fixture_model), modes=("plain", "llamacpp"))
    ggufs = {"native": Path("a.gguf"), "f32": Path("a.f32.gguf")}
    modes = expand_modes(config, engine, ggufs)
    assert [(m.name, m.backend, m.gguf) for m in modes] == [
        ("plain", "ours", None),
        ("llamacpp-native", "llamacpp", "native"),
        ("llamacpp-f32", "llamacpp", "f32"),
    ]
    assert [m.name for m in expand_modes(config, engine, {})] == ["plain"]


def test_plain_f32_row_only_for_a_quantized_model(fixture_model: Path, tmp_path: Path) -> None:
    import shutil

    from mtplx.bench.runner import BenchConfig, expand_modes
    from mtplx.engine import Engine
    from mtplx.models import load
    from tests.fixtures.variants import quantize_checkpoint

    config = BenchConfig(model=str(fixture_model), modes=("plain", "plain-f32"))
    assert [m.name for m in expand_modes(config, Engine(load(str(fixture_model))), {})] == ["plain"]
    copy = quantize_checkpoint(Path(shutil.copytree(fixture_model, tmp_path / "q")))
    modes = expand_modes(config, Engine(load(str(copy))), {})
    assert [(m.name, m.backend) for m in modes] == [("plain", "ours"), ("plain-f32", "ours-f32")]


def test_llamacpp_rows_in_a_run(fixture_model: Path, tmp_path: Path, monkeypatch) -> None:
    from mtplx.bench import runner
    from mtplx.cli import main

    ggufs = {"native": tmp_path / "a.gguf", "f32": tmp_path / "a.f32.gguf"}
    monkeypatch.setattr(runner, "llamacpp_ggufs", lambda config: ggufs)
    monkeypatch.setattr(runner, "load_llamacpp", lambda path, n_ctx: FakeLlama())
    prompts = tmp_path / "prompts"
    prompts.mkdir()
    (prompts / "chat.jsonl").write_text('{"id": "c1", "prompt": "hello there"}\n')
    out = tmp_path / "out"
    argv = [
        "bench", str(fixture_model), "--modes", "plain,llamacpp", "--samplers", "greedy",
        "--max-tokens", "4", "--repeats", "1", "--prompt-dir", str(prompts), "--out", str(out),
        "--no-progress",
    ]  # fmt: skip
    assert main(argv) == 0
    rows = {r["mode"]: r for r in json.loads((out / "results.json").read_text())["summary"]}
    assert rows["llamacpp-f32"]["peak_memory_mb"] is None
    assert rows["llamacpp-f32"]["same_tokens_as_plain"] == 0.0  # the fake counts 1, 2, 3, 4
    md = (out / "results.md").read_text()
    assert "| chat | llamacpp-native |" in md
    assert next(line for line in md.splitlines() if "| chat | llamacpp-f32 |" in line).endswith(
        "| – | 0% |"
    )
