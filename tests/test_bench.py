"""kvp-bench (src/bench/, python/kvp_cpp/bench.py, python/kvp_cpp/plot.py): the C++ metrics against
kvp_cpp.metrics, one prefill per sample in the oneshot protocol, the reference left intact by a sweep, the cache
within budget, the JSON/CSV schema, resuming, the bounded protocol, perplexity, the launcher and the plots."""
from __future__ import annotations

import csv
import json
import math
import os
import subprocess
import sys

import pytest

import kvp_cpp
from kvp_cpp import bench, plot
from kvp_cpp.metrics import match_all, match_part, postprocess_prediction, score

TARGET_LENGTH = 384
SAMPLES = 2
MAX_NEW_TOKENS = 8
BUDGETS = (64, 1024)  # 1024 holds every prompt: nothing is evicted
VARIANTS = ("question_included", "question_excluded")  # the default of --tasks in the oneshot protocol


def run_bench(*args: str) -> subprocess.CompletedProcess:
    result = subprocess.run([bench.binary_path(), *args], capture_output=True, text=True, timeout=300)
    if result.returncode != 0:
        raise AssertionError(f"kvp-bench failed ({result.returncode}):\n{result.stderr}")
    return result


def read_log(json_path, skip_lines=()) -> list:
    with open(str(json_path)[: -len(".json")] + ".samples.jsonl", encoding="utf-8") as f:
        return [json.loads(line) for i, line in enumerate(f) if line.strip() and i not in skip_lines]


def by_key(records) -> dict:
    return {(r["variant"], r["task"], r["index"], r["policy"], r["budget"]): r for r in records}


@pytest.fixture(scope="module")
def tasks_file(tmp_path_factory, model_path):
    from kvp_cpp.ruler import LlamaTokenizer, generate

    tokenizer = LlamaTokenizer(model_path)
    path = tmp_path_factory.mktemp("tasks") / "niah.jsonl"
    with open(path, "w", encoding="utf-8") as f:
        for record in generate("niah_single_1", TARGET_LENGTH, SAMPLES, tokenizer):
            f.write(json.dumps(record) + "\n")
    return path


@pytest.fixture(scope="module")
def learned(tmp_path_factory):
    """A learned policy with random weights: its engines capture K/V of every layer through the eval callback."""
    from kvp_cpp import policy_file

    path = tmp_path_factory.mktemp("policy") / "random.kvp.bin"
    policy_file.write_policy(path, policy_file.random_policy(**policy_file.smollm2_identity(), hidden=(16,), seed=3))
    return f"kvp:{path}"


@pytest.fixture(scope="module")
def sweep_policies(learned):
    return ["streaming", "random", learned, "full"]  # full last: it runs after the others restored and evicted


@pytest.fixture(scope="module")
def sweep(tmp_path_factory, model_path, tasks_file, sweep_policies):
    """One oneshot sweep: SAMPLES samples x 2 variants x (3 policies x 2 budgets + full)."""
    out = tmp_path_factory.mktemp("sweep") / "results.json"
    args = ["-m", model_path, "--tasks", str(tasks_file), "--policies", ",".join(sweep_policies),
            "--budgets", ",".join(map(str, BUDGETS)), "--max-new-tokens", str(MAX_NEW_TOKENS), "-o", str(out)]
    result = run_bench(*args)
    with open(out, encoding="utf-8") as f:
        document = json.load(f)
    return {"args": args, "out": out, "stdout": result.stdout, "stderr": result.stderr, "document": document,
            "records": read_log(out)}


# ------------------------------------------------------------------------------------------------ metrics


METRIC_CASES = [
    ("  The number is 1234567.\n", ["1234567"], "string_match_all", 100.0),
    ("apple, BANANA and cherry", ["apple", "banana", "kiwi", "plum"], "string_match_all", 50.0),
    ("\x07NOTHING\x00here\x1f", ["nothing\nhere"], "string_match_all", 100.0),  # control chars become newlines
    ("", ["x"], "string_match_all", 0.0),
    ("It was in PARIS.", ["Paris", "France"], "string_match_part", 100.0),
    ("London?", ["Berlin"], "string_match_part", 0.0),
    ("no IDEA", ["yes", "idea"], "string_match_part", 100.0),
    ("one two", ["one", "two", "three"], "string_match_all", 100.0 * 2 / 3),
]


def test_cpp_metrics_match_hand_made_cases_and_kvp_cpp_metrics(tmp_path):
    path = tmp_path / "predictions.jsonl"
    with open(path, "w", encoding="utf-8") as f:
        for prediction, outputs, metric, _ in METRIC_CASES:
            f.write(json.dumps({"prediction": prediction, "outputs": outputs, "metric": metric}) + "\n")
    result = json.loads(run_bench("--score-predictions", str(path)).stdout)

    per_sample = {"string_match_all": match_all, "string_match_part": match_part}
    for (prediction, outputs, metric, expected), got in zip(METRIC_CASES, result["scores"]):
        assert got == pytest.approx(expected)
        assert got == pytest.approx(100 * per_sample[metric](postprocess_prediction(prediction), outputs))
    for metric in per_sample:
        cases = [c for c in METRIC_CASES if c[2] == metric]
        assert result["aggregate"][metric] == score(metric, [c[0] for c in cases], [c[1] for c in cases])


# ------------------------------------------------------------------------------------------------ oneshot


def test_oneshot_prefills_each_sample_once_whatever_the_number_of_policies_and_budgets(sweep, tasks_file):
    run, records = sweep["document"]["run"], sweep["records"]
    with open(tasks_file, encoding="utf-8") as f:
        samples = [json.loads(line) for line in f]
    prompt_tokens = {s["index"]: s["length"] for s in samples}  # SmolLM2 adds no BOS: same count as the generator
    assert len(records) == SAMPLES * len(VARIANTS) * (3 * len(BUDGETS) + 1)
    assert all(r["prompt_tokens"] == prompt_tokens[r["index"]] for r in records)

    # One prefill of each sample's context serves both variants; the question_included engines then read the
    # question, all but the last prompt token, which each result decodes after compression.
    assert run["shared_prefills"] == SAMPLES
    assert run["shared_prefill_tokens"] == sum(n - 1 for n in prompt_tokens.values())
    assert run["decoded_tokens"] == run["shared_prefill_tokens"] + sum(r["decoded_tokens"] for r in records)
    for r in records:
        appended = r["prompt_tokens"] - r["context_tokens"]  # decoded after compression
        if r["variant"] == "question_included":
            assert appended == 1
        else:
            assert 5 < appended < 0.5 * r["prompt_tokens"]  # the question, the template's tail, the answer prefix
        # the last generated token is fed only if generation goes on after it (not at max_new_tokens)
        hit_max = r["generated_tokens"] == MAX_NEW_TOKENS
        assert r["decoded_tokens"] == appended + r["generated_tokens"] - hit_max


def test_each_result_is_the_one_its_policy_gives_alone(sweep, tmp_path, model_path, tasks_file, learned):
    """Neither the reference nor a learned engine is disturbed by the other engines that followed the same prefill
    and by the results computed before it from the restored state."""
    alone = tmp_path / "alone.json"
    run_bench("-m", model_path, "--tasks", str(tasks_file), "--samples", "1", "--policies", f"{learned},full",
              "--budgets", str(min(BUDGETS)), "--max-new-tokens", str(MAX_NEW_TOKENS), "-o", str(alone))
    in_sweep = by_key(sweep["records"])
    alone_records = read_log(alone)
    assert len(alone_records) == 2 * len(VARIANTS)
    for r in alone_records:
        swept = in_sweep[(r["variant"], r["task"], r["index"], r["policy"], r["budget"])]
        fields = ("prediction", "score", "llama_cells", "tokens_evicted", "kept_digest")
        assert [swept[f] for f in fields] == [r[f] for f in fields]
    # A budget that holds the whole prompt evicts nothing: the restored prefill gives the reference's answer.
    for r in sweep["records"]:
        if r["budget"] == max(BUDGETS):
            reference = in_sweep[(r["variant"], r["task"], r["index"], "full", None)]
            assert r["tokens_evicted"] == 0
            assert (r["prediction"], r["kept_digest"]) == (reference["prediction"], reference["kept_digest"])


def test_every_result_compresses_its_context_to_the_budget_then_appends(sweep):
    """The paper's and kvpress's oneshot protocol: compress once, then what follows (the question when it is
    excluded, the answer) is appended to the compressed cache without further eviction."""
    for r in sweep["records"]:
        if r["budget"] is None:  # full: the context plus every decoded token after it, in llama.cpp's own count
            assert r["llama_cells"] == r["cells_max"] == r["context_tokens"] + r["decoded_tokens"]
            assert r["compressed_cells"] == r["context_tokens"]
        else:
            assert r["compressed_cells"] == min(r["budget"], r["context_tokens"])
            assert r["tokens_evicted"] == r["context_tokens"] - r["compressed_cells"]
            assert 0 < r["llama_cells"] <= r["cells_max"] == r["compressed_cells"] + r["decoded_tokens"]
            if r["variant"] == "question_excluded" and r["budget"] < r["context_tokens"]:
                assert r["tokens_evicted"] > 0 and r["cells_max"] > r["budget"]  # the question stayed whole


def test_stretch_keeps_the_oldest_candidates_whole_when_nothing_stands_out(tmp_path, model_path, tasks_file):
    """--stretch X: with a threshold no keep-score reaches, the whole kept share is the stretch of the oldest
    candidates, whichever policy ranks (keydiff and knorm keep the same cells), and it is not what either keeps
    without it. Bad values are refused before any work."""
    def kept(policy: str, *extra: str) -> list:
        out = tmp_path / f"{policy}{len(extra)}.json"
        run_bench("-m", model_path, "--tasks", str(tasks_file), "--policies", policy, "--budgets", "64",
                  "--variants", "question_included", "--evict-unit", "token", "--max-new-tokens", "2", *extra,
                  "-o", str(out))
        with open(out, encoding="utf-8") as f:
            assert json.load(f)["config"]["stretch"] == (float(extra[1]) if extra else 0.0)
        return [r["kept_digest"] for r in read_log(out)]

    stretched = kept("keydiff", "--stretch", "1e9")
    assert len(stretched) == SAMPLES
    assert kept("knorm", "--stretch", "1e9") == stretched
    assert kept("keydiff") != stretched and kept("knorm") != stretched
    for bad, code, message in ((["--stretch", "-1"], 2, "--stretch needs a finite number >= 0"),
                               (["--stretch", "2", "--combine", "mean"], 1, "--stretch needs --combine")):
        result = subprocess.run([bench.binary_path(), "-m", model_path, "--tasks", str(tasks_file), "--policies",
                                 "keydiff", *bad, "-o", str(tmp_path / "bad.json")],
                                capture_output=True, text=True, timeout=120)
        assert result.returncode == code and message in result.stderr, result.stderr


def test_question_excluded_needs_the_question_field(tmp_path, model_path, tasks_file):
    stripped = tmp_path / "no-question.jsonl"
    with open(tasks_file, encoding="utf-8") as f, open(stripped, "w", encoding="utf-8") as out:
        for line in f:
            record = json.loads(line)
            del record["question"]
            out.write(json.dumps(record) + "\n")
    common = ["-m", model_path, "--tasks", str(stripped), "--samples", "1", "--policies", "streaming",
              "--budgets", "64", "--max-new-tokens", "2"]
    result = subprocess.run([bench.binary_path(), *common, "--variants", "question_excluded", "-o",
                             str(tmp_path / "x.json")], capture_output=True, text=True, timeout=120)
    assert result.returncode == 1 and "needs the 'question' field" in result.stderr
    defaulted = run_bench(*common, "-o", str(tmp_path / "y.json"))  # the default falls back to question_included
    assert "running question_included only" in defaulted.stderr
    assert [r["variant"] for r in read_log(tmp_path / "y.json")] == ["question_included"]
    for bad, message in ((["--variants", "question_maybe"], "--variants takes"),
                         (["--protocol", "bounded", "--variants", "question_excluded"], "only question_included")):
        result = subprocess.run([bench.binary_path(), *common, *bad], capture_output=True, text=True, timeout=60)
        assert result.returncode == 2 and message in result.stderr


# ------------------------------------------------------------------------------------------------ outputs


def test_json_and_csv_hold_the_same_rows_and_the_table_shows_them(sweep, sweep_policies):
    document, out = sweep["document"], sweep["out"]
    assert document["schema"] == "kvp-bench/1" and document["mode"] == "tasks"
    assert document["config"]["protocol"] == "oneshot"
    assert [p["label"] for p in document["config"]["policies"]] == sweep_policies
    assert [p["captures_kv"] for p in document["config"]["policies"]] == [False, False, True, False]
    assert document["model"]["identity"]["n_layer"] == 30
    assert document["config"]["variants"] == list(VARIANTS)
    rows = document["results"]
    assert [(r["variant"], r["policy"], r["budget"]) for r in rows] == [
        (variant, policy, budget) for variant in VARIANTS
        for policy, budget in [(p, b) for p in sweep_policies[:-1] for b in BUDGETS] + [("full", None)]]

    with open(str(out)[: -len(".json")] + ".csv", newline="", encoding="utf-8") as f:
        csv_rows = list(csv.DictReader(f))
    assert len(csv_rows) == len(rows)
    for row, csv_row in zip(rows, csv_rows):
        assert list(csv_row) == list(row)
        for field, value in row.items():
            text = csv_row[field]
            if value is None:
                assert text == ""
            elif isinstance(value, str):
                assert text == value
            else:
                assert float(text) == value  # shortest round-trip formatting on both sides

    for row in rows:
        per_sample = [r for r in sweep["records"]
                      if (r["variant"], r["policy"], r["budget"]) == (row["variant"], row["policy"], row["budget"])]
        assert row["n"] == len(per_sample) == SAMPLES
        assert row["score"] == round(sum(r["score"] for r in per_sample) / SAMPLES, 2)
    table = [[cell.strip() for cell in line.strip("|").split("|")] for line in sweep["stdout"].splitlines()]
    assert table[0] == ["variant", "policy", "budget", "task", "length", "score ± stderr", "n"]
    label = {"word": " (words)", "token": ""}  # kvp-bench's default unit is word; the full cache has none
    assert [row["evict_unit"] for row in rows] == ["token" if row["policy"] == "full" else "word" for row in rows]
    assert table[2:] == [[row["variant"], plot.short_label(row["policy"]) + label[row["evict_unit"]],
                          "-" if row["budget"] is None else str(row["budget"]),
                          row["task"], str(row["length"]), f"{row['score']:.2f} ± {row['stderr']:.2f}", str(row["n"])]
                         for row in rows]


def test_a_rerun_skips_done_samples_and_an_interrupted_one_finishes_what_is_missing(sweep, tmp_path):
    done = run_bench(*sweep["args"])
    with open(sweep["out"], encoding="utf-8") as f:
        document = json.load(f)
    run = document["run"]
    assert (run["results_computed"], run["shared_prefills"], run["decoded_tokens"]) == (0, 0, 0)
    assert run["results_resumed"] == len(sweep["records"])
    assert document["results"] == sweep["document"]["results"]
    assert done.stdout == sweep["stdout"]

    # An interrupted run: the log holds the first sample's results and half a line of the next one.
    out = tmp_path / "interrupted.json"
    first = [r for r in sweep["records"] if r["index"] == 0]
    with open(tmp_path / "interrupted.samples.jsonl", "w", encoding="utf-8") as f:
        for r in first:
            f.write(json.dumps(r) + "\n")
        f.write(json.dumps(sweep["records"][-1])[:40])
    args = list(sweep["args"])
    args[args.index("-o") + 1] = str(out)
    result = run_bench(*args)
    assert "ignored 1 unreadable line" in result.stderr
    with open(out, encoding="utf-8") as f:
        run = json.load(f)["run"]
    assert (run["results_resumed"], run["results_computed"], run["shared_prefills"]) == (len(first), len(first), 1)
    def outcomes(records):
        return {key: (r["prediction"], r["score"], r["llama_cells"], r["decoded_tokens"])
                for key, r in by_key(records).items()}

    assert outcomes(read_log(out, skip_lines={len(first)})) == outcomes(sweep["records"])


def test_a_rerun_refuses_results_of_a_policy_file_that_changed_since(tmp_path, model_path, tasks_file):
    from kvp_cpp import policy_file

    policy = tmp_path / "p.kvp.bin"
    policy_file.write_policy(policy, policy_file.random_policy(**policy_file.smollm2_identity(), hidden=(8,), seed=1))
    out = tmp_path / "r.json"
    args = ["-m", model_path, "--tasks", str(tasks_file), "--policies", f"kvp:{policy}", "--budgets", "64",
            "--variants", "question_included", "--samples", "1", "--max-new-tokens", "2", "-o", str(out)]
    run_bench(*args)
    (record,) = read_log(out)
    digest = 0xCBF29CE484222325  # FNV-1a 64 of the file's bytes, as the log documents it
    for byte in policy.read_bytes():
        digest = ((digest ^ byte) * 0x100000001B3) % 2**64
    assert record["policy_digest"] == f"{digest:016x}"
    run_bench(*args)  # the same file: everything is resumed
    policy_file.write_policy(policy, policy_file.random_policy(**policy_file.smollm2_identity(), hidden=(8,), seed=2))
    changed = subprocess.run([bench.binary_path(), *args], capture_output=True, text=True, timeout=120)
    assert changed.returncode != 0
    assert f"holds results of kvp:{policy} from another version of the file" in changed.stderr
    assert record["policy_digest"] in changed.stderr
    assert read_log(out) == [record]  # nothing was appended


# ------------------------------------------------------------------------------------------------ other modes


def test_bounded_protocol_prefills_per_budget_under_the_budget(tmp_path, model_path, tasks_file):
    out = tmp_path / "bounded.json"
    budget = 128
    run_bench("-m", model_path, "--tasks", str(tasks_file), "--samples", "1", "--protocol", "bounded",
              "--policies", "streaming", "--budgets", str(budget), "--max-new-tokens", "4", "-o", str(out))
    with open(out, encoding="utf-8") as f:
        document = json.load(f)
    (record,) = read_log(out)
    assert document["run"]["shared_prefills"] == 0
    assert document["run"]["decoded_tokens"] == record["decoded_tokens"]
    assert record["protocol"] == "bounded"
    assert record["decoded_tokens"] >= record["prompt_tokens"]  # the result prefilled the whole prompt itself
    assert record["tokens_evicted"] >= record["prompt_tokens"] - budget
    assert 0 < record["llama_cells"] <= record["cells_max"] <= budget


def test_perplexity_windows_stay_inside_each_jsonl_document(tmp_path, model_path):
    """A .jsonl text file holds documents (chats): each is cut into its own windows, and a window scores exactly
    what the same document alone in a .txt file scores."""
    from kvp_cpp.ruler import sources

    words = sources.essay_words()
    first, second, short = " ".join(words[:300]), " ".join(words[1000:1300]), " ".join(words[2000:2010])
    docs = tmp_path / "chats.jsonl"
    docs.write_text("".join(json.dumps({"text": t}) + "\n" for t in (first, short, second)), encoding="utf-8")
    common = ("--ctx", "96", "--cont", "16", "--policies", "full", "--budgets", "64")
    run_bench("-m", model_path, "--text", str(docs), *common, "-o", str(tmp_path / "docs.json"))
    with open(tmp_path / "docs.json", encoding="utf-8") as f:
        windows = [r for r in json.load(f)["results"]]
    logged = sorted(read_log(tmp_path / "docs.json"), key=lambda r: r["index"])
    alone = []
    for name, text in (("first", first), ("second", second)):
        path = tmp_path / f"{name}.txt"
        path.write_text(text, encoding="utf-8")
        run_bench("-m", model_path, "--text", str(path), *common, "-o", str(tmp_path / f"{name}.json"))
        alone += sorted(read_log(tmp_path / f"{name}.json"), key=lambda r: r["index"])
    assert {r["task"] for r in windows} == {"ppl:chats"}
    assert len(logged) == len(alone) >= 2  # the 10-word document has no window
    for in_file, by_itself in zip(logged, alone):
        assert in_file["score"] == pytest.approx(by_itself["score"], abs=1e-5)

    (tmp_path / "bad.jsonl").write_text('{"text": "fine"}\n{"txt": 1}\n', encoding="utf-8")
    bad = subprocess.run([bench.binary_path(), "-m", model_path, "--text", str(tmp_path / "bad.jsonl"), *common,
                          "-o", str(tmp_path / "bad.json")], capture_output=True, text=True, timeout=120)
    assert bad.returncode != 0 and "line 2" in bad.stderr and '"text"' in bad.stderr


def test_perplexity_of_a_continuation_after_one_shared_prefill(tmp_path, model_path):
    from kvp_cpp.ruler import sources

    text = tmp_path / "essay.txt"
    text.write_text(" ".join(sources.essay_words()[:600]), encoding="utf-8")
    out = tmp_path / "ppl.json"
    run_bench("-m", model_path, "--text", str(text), "--ctx", "192", "--cont", "32", "--samples", "1",
              "--policies", "full,streaming", "--budgets", "48,256", "-o", str(out))
    with open(out, encoding="utf-8") as f:
        document = json.load(f)
    assert document["mode"] == "perplexity" and document["run"]["shared_prefills"] == 1
    rows = {(r["policy"], r["budget"]): r for r in document["results"]}
    assert {r["metric"] for r in rows.values()} == {"mean_nll"} and {r["task"] for r in rows.values()} == {"ppl:essay"}
    full, kept_all, squeezed = rows[("full", None)], rows[("streaming", 256)], rows[("streaming", 48)]
    assert 0 < full["score"] < math.log(49152)  # better than uniform over the vocabulary
    assert kept_all["score"] == pytest.approx(full["score"], abs=1e-4)  # 256 cells hold all 224 tokens
    assert squeezed["score"] != full["score"]
    for r in read_log(out):
        assert r["variant"] == "continuation"
        assert r["generated_tokens"] == 32 and r["decoded_tokens"] == 32  # held-back token + 31 teacher-forced
        if r["budget"] == 48:  # compressed to the budget, then the continuation is appended
            assert r["compressed_cells"] == 48 and r["cells_max"] == 48 + 32


def test_speed_mode_times_every_policy_against_the_full_cache_in_one_run(tmp_path, model_path):
    out = tmp_path / "speed.json"
    contexts, budgets, decode = (96, 160), (64, 256), 4
    result = run_bench("-m", model_path, "--speed", "--contexts", ",".join(map(str, contexts)), "--policies",
                       "streaming,knorm,full", "--budgets", ",".join(map(str, budgets)), "--decode-tokens",
                       str(decode), "-t", "2", "-o", str(out))
    with open(out, encoding="utf-8") as f:
        document = json.load(f)
    assert document["mode"] == "speed" and document["config"]["contexts"] == list(contexts)
    rows = document["speed"]
    # per context: the full cache first (every ratio is to it), then each policy and budget
    assert [(r["context"], r["policy"], r["budget"]) for r in rows] == [
        (c, p, b) for c in contexts for p, b in [("full", None)] + [(p, b) for p in ("streaming", "knorm")
                                                                      for b in budgets]]
    per_cell = document["model"]["kv_bytes_per_cell"]
    for r in rows:
        assert r["status"] == "ok" and r["prefill_tokens_per_second"] > 0 and r["decode_ms_per_token"] > 0
        assert r["kv_bytes"] == r["n_ctx"] * per_cell and r["rss_bytes"] > 0
        if r["budget"] is None:
            assert r["prefill_vs_full"] == r["decode_vs_full"] == 1.0
            assert r["n_ctx"] >= r["context"] + decode and r["cells_max"] == r["context"] + decode
            assert r["tokens_evicted"] == 0
            continue
        full = next(f for f in rows if f["context"] == r["context"] and f["budget"] is None)
        assert r["prefill_vs_full"] == pytest.approx(r["prefill_tokens_per_second"] / full["prefill_tokens_per_second"])
        assert r["decode_vs_full"] == pytest.approx(full["decode_ms_per_token"] / r["decode_ms_per_token"])
        assert r["cells_max"] <= r["budget"] <= r["n_ctx"]  # the bounded protocol, as kvp_cpp.Llama runs
        if r["budget"] < r["context"] + decode:
            assert r["tokens_evicted"] >= r["context"] + decode - r["budget"]
        else:
            assert r["tokens_evicted"] == 0
        if r["policy"] == "knorm":  # captures keys: its capture and scoring time is measured
            assert r["copy_ms_per_token"] > 0 and r["score_ms_per_token"] > 0
        else:
            assert r["copy_ms_per_token"] == r["score_ms_per_token"] == 0
    with open(str(out)[: -len(".json")] + ".csv", newline="", encoding="utf-8") as f:
        csv_rows = list(csv.DictReader(f))
    assert [list(c) for c in csv_rows] == [list(r) for r in rows]
    table = [[cell.strip() for cell in line.strip("|").split("|")] for line in result.stdout.splitlines()]
    assert table[0][:5] == ["policy", "budget", "context", "prefill t/s", "prefill vs full"]
    assert len(table) == 2 + len(rows)
    assert subprocess.run([bench.binary_path(), "-m", model_path, "--speed", "--tasks", "x.jsonl"],
                          capture_output=True, text=True).returncode == 2


# ------------------------------------------------------------------------------------------------ launcher, plots


def test_launcher_adds_the_default_model_and_sweep(monkeypatch, model_path):
    monkeypatch.setattr(bench, "default_tasks_file", lambda model: f"/cache/{os.path.basename(model)}.jsonl")
    cmd = bench.command([])
    assert cmd[0] == bench.binary_path()
    assert cmd[cmd.index("-m") + 1] == model_path
    assert cmd[cmd.index("--tasks") + 1] == f"/cache/{os.path.basename(model_path)}.jsonl"
    # the shipped learned policy for the default model joins the default sweep, as kvp:PATH
    shipped = kvp_cpp.shipped_policy_for(kvp_cpp.model_identity(model_path))
    assert cmd[cmd.index("--policies") + 1] == f"{bench.DEFAULT_POLICIES},kvp:{shipped}"
    assert cmd[cmd.index("--budgets") + 1] == bench.DEFAULT_BUDGETS
    named = bench.command(["--tasks", "t.jsonl", "--policies", "full,kvp,knorm,kvp-chat"])
    chat = kvp_cpp.shipped_policy_for(kvp_cpp.model_identity(model_path), "chat")
    assert chat != shipped and chat.endswith("smollm2-135m-instruct.chat.kvp.bin")
    assert named[named.index("--policies") + 1] == f"full,kvp:{shipped},knorm,kvp:{chat}"
    speed = bench.command(["--speed"])
    assert "--tasks" not in speed and speed[speed.index("--budgets") + 1] == bench.DEFAULT_SPEED_BUDGETS
    assert speed[speed.index("--policies") + 1] == f"{bench.DEFAULT_POLICIES},kvp:{shipped}"
    given = bench.command(["-m", "x.gguf", "--tasks", "t.jsonl", "--budgets", "64"])
    assert given == [bench.binary_path(), "-m", "x.gguf", "--tasks", "t.jsonl", "--budgets", "64"]


def test_console_script_runs_the_binary_from_anywhere(tmp_path):
    script = os.path.join(os.path.dirname(sys.executable), "kvp-bench")
    result = subprocess.run([script, "--help"], capture_output=True, text=True, cwd=tmp_path, timeout=60)
    assert result.returncode == 0, result.stderr
    from kvp_cpp import builtin_policies

    assert all(name in result.stdout for name in builtin_policies())
    bad = subprocess.run([script, "--tasks", "t.jsonl", "--bogus"], capture_output=True, text=True, cwd=tmp_path)
    assert bad.returncode == 2 and "unknown argument '--bogus'" in bad.stderr


def test_plots_are_written_for_tasks(sweep, tmp_path):
    pytest.importorskip("matplotlib")
    paths = plot.plot(plot.load_results(str(sweep["out"])), str(tmp_path), "results")
    assert [os.path.basename(p) for p in paths] == ["results-score.png", "results-tasks.png"]
    for path in paths:
        with open(path, "rb") as f:
            assert f.read(8) == b"\x89PNG\r\n\x1a\n"


def test_plot_draws_several_runs_together_and_refuses_other_models(sweep, tmp_path):
    """Two runs (here the same sweep, relabelled as another length) become one document whose panels are both
    lengths; runs of different models are refused."""
    pytest.importorskip("matplotlib")
    document = plot.load_results(str(sweep["out"]))
    longer = dict(document, results=[dict(r, length=r["length"] * 2) for r in document["results"]])
    longer_path = tmp_path / "longer.json"
    longer_path.write_text(json.dumps(longer))
    merged = plot.merge_results([document, longer])
    assert len(merged["results"]) == 2 * len(document["results"])
    assert sorted({r["length"] for r in merged["results"]}) == sorted(
        {r["length"] for r in document["results"]} | {2 * r["length"] for r in document["results"]})
    assert plot.main([str(sweep["out"]), str(longer_path), "-o", str(tmp_path / "png"), "--stem", "both"]) == 0
    assert sorted(os.listdir(tmp_path / "png")) == ["both-score.png", "both-tasks.png"]
    other = dict(document, model=dict(document["model"], name="gemma-3-270m.gguf"))
    with pytest.raises(ValueError, match="different models"):
        plot.merge_results([document, other])


def test_plot_legend_lists_series_of_any_panel_in_one_colour_each():
    """A series drawn in only one panel (a per-head run at one length) gets a legend entry, and every series keeps
    its colour from panel to panel, also when the panels hold different sets of series."""
    pytest.importorskip("matplotlib")
    plt = plot._pyplot()
    rows = [{"policy": "full", "budget": None}, {"policy": "knorm", "budget": 128},
            {"policy": "kvp:a.kvp.bin", "budget": 128}, {"policy": "kvp:a.kvp.bin (per head)", "budget": 128}]
    colors = plot._colors(plt, rows)
    assert set(colors) == {"knorm", "kvp:a.kvp.bin", "kvp:a.kvp.bin (per head)"}
    assert len(set(colors.values())) == 3
    figure, axes = plot._grid(plt, 2)
    plot._draw_panel(axes[0], {"full": [(None, 20.0, 0.0)], "kvp:a.kvp.bin": [(128, 10.0, 1.0), (256, 12.0, 1.0)]},
                     {}, colors)
    plot._draw_panel(axes[1], {"knorm": [(128, 1.0, 0.5), (256, 2.0, 0.5)],
                               "kvp:a.kvp.bin (per head)": [(128, 15.0, 1.0), (256, 16.0, 1.0)],
                               "kvp:a.kvp.bin": [(128, 9.0, 1.0), (256, 11.0, 1.0)]}, {}, colors)
    plot._legend_outside(figure, axes)
    legend = [text.get_text() for text in figure.legends[0].get_texts()]
    assert legend == ["full", "kvp:a", "knorm", "kvp:a (per head)"]
    line_colors = [{line.get_label(): line.get_color() for line in ax.get_lines()} for ax in axes]
    assert line_colors[0]["kvp:a"] == line_colors[1]["kvp:a"] == colors["kvp:a.kvp.bin"]
    assert line_colors[1]["kvp:a (per head)"] == colors["kvp:a.kvp.bin (per head)"]
    plt.close(figure)


def test_per_head_mode_needs_the_patched_library(monkeypatch, tmp_path, model_path, tasks_file):
    """The binary on llama-cpp-python's own library refuses --kv-modes per_head before any work, and the launcher
    names the build command when the patched library is missing."""
    result = subprocess.run([bench.binary_path(), "-m", model_path, "--tasks", str(tasks_file), "--policies",
                             "keydiff", "--kv-modes", "shared,per_head", "-o", str(tmp_path / "x.json")],
                            capture_output=True, text=True, timeout=120)
    assert result.returncode == 1 and "needs the patched llama.cpp" in result.stderr
    assert not (tmp_path / "x.samples.jsonl").exists()
    per_layer = subprocess.run([bench.binary_path(), "-m", model_path, "--tasks", str(tasks_file), "--policies", "tova",
                                "--kv-modes", "per_head", "-o", str(tmp_path / "x.json")],
                               capture_output=True, text=True, timeout=120)
    assert per_layer.returncode == 1 and "tova scores per layer, not per KV head" in per_layer.stderr
    bad = subprocess.run([bench.binary_path(), "-m", model_path, "--tasks", str(tasks_file), "--kv-modes", "per_layer"],
                         capture_output=True, text=True, timeout=120)
    assert bad.returncode == 2 and "--kv-modes takes shared and per_head" in bad.stderr
    consensus = subprocess.run([bench.binary_path(), "-m", model_path, "--tasks", str(tasks_file), "--policies",
                                "keydiff", "--head-consensus", "0.5", "-o", str(tmp_path / "x.json")],
                               capture_output=True, text=True, timeout=120)
    assert consensus.returncode == 1 and "--head-consensus applies to per-head eviction" in consensus.stderr
    out_of_range = subprocess.run([bench.binary_path(), "-m", model_path, "--tasks", str(tasks_file),
                                   "--head-consensus", "2"], capture_output=True, text=True, timeout=120)
    assert out_of_range.returncode == 2 and "--head-consensus" in out_of_range.stderr

    from kvp_cpp import _llama_lib

    monkeypatch.setattr(_llama_lib, "is_built", lambda: False)
    assert bench.environment(["kvp-bench", "--kv-modes", "shared"]) == dict(os.environ)
    with pytest.raises(SystemExit, match="python -m kvp_cpp.llama_build"):
        bench.environment(["kvp-bench", "--kv-modes", "shared,per_head"])
    monkeypatch.setattr(_llama_lib, "is_built", lambda: True)
    env = bench.environment(["kvp-bench", "--kv-modes", "per_head"])
    assert env["LD_LIBRARY_PATH"].split(os.pathsep)[0] == str(_llama_lib.lib_dir())
