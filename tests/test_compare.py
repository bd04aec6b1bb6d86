"""kvp_cpp.compare: paired comparisons of kvp-bench per-sample logs, on hand-made logs whose numbers are worked out
here by hand."""
import json
import math

import pytest

from kvp_cpp import compare


def record(task, index, policy, budget, score, kv_mode="shared", length=2048):
    return {"model": "m.gguf", "protocol": "oneshot", "variant": "question_included", "task": task,
            "length": length, "index": index, "policy": policy, "kv_mode": kv_mode, "budget": budget,
            "metric": "string_match_all", "score": score}


# Two tasks, three samples each. kvp and keydiff at budgets 128 and 256; the full cache solves "easy" (100) and
# not "hard" (0). Sample ("hard", 2) lacks keydiff@256, so it is not complete and every table leaves it out.
KVP = "kvp:models/x.kvp.bin"
SCORES = {  # (task, index): (full, kvp@128, kvp@256, keydiff@128, keydiff@256)
    ("easy", 0): (100, 100, 100, 0, 100),
    ("easy", 1): (100, 0, 100, 0, 100),
    ("easy", 2): (100, 100, 100, 100, 0),
    ("hard", 0): (0, 0, 0, 0, 0),
    ("hard", 1): (0, 50, 0, 0, 0),
    ("hard", 2): (0, 0, 0, 0, None),
}


def write_log(path, extra=()):
    lines = []
    for (task, index), (full, k128, k256, d128, d256) in SCORES.items():
        lines.append(record(task, index, "full", None, full))
        lines.append(record(task, index, KVP, 128, k128))
        lines.append(record(task, index, KVP, 256, k256))
        lines.append(record(task, index, "keydiff", 128, d128))
        if d256 is not None:
            lines.append(record(task, index, "keydiff", 256, d256))
    lines += list(extra)
    with open(path, "w", encoding="utf-8") as f:
        for line in lines:
            f.write(json.dumps(line) + "\n")
        f.write('{"task": "easy", "index": 0, "pol')  # a line cut off by an interrupted run


def test_means_and_paired_differences_on_complete_samples(tmp_path):
    log = tmp_path / "run.samples.jsonl"
    write_log(log, extra=[record("easy", 0, KVP, 128, 100)])  # a resumed run wrote one result twice
    records = compare.read_logs([str(log)])
    result = compare.compare(records, "kvp:x")[("oneshot", "question_included", 2048)]
    assert result["tasks"] == ["easy", "hard"] and result["samples_per_task"] == {"easy": 3, "hard": 2}
    assert result["budgets"] == [128, 256]
    assert result["full"]["mean"] == pytest.approx(50.0)
    # kvp@128: easy 200/3, hard 50/2 -> mean of task means (66.67 + 25) / 2
    assert result["series"]["kvp:x"]["128"]["mean"] == pytest.approx((200 / 3 + 25) / 2)
    assert result["series"]["keydiff"]["256"]["per_task"] == pytest.approx({"easy": 200 / 3, "hard": 0.0})
    # paired kvp - keydiff at 128 over the 5 complete samples: 100, 0, 0, 0, 50
    paired = result["paired"]["keydiff"]["128"]
    differences = [100, 0, 0, 0, 50]
    mean = sum(differences) / 5
    stderr = math.sqrt(sum((d - mean) ** 2 for d in differences) / 4 / 5)
    assert paired["mean"] == pytest.approx(mean) and paired["stderr"] == pytest.approx(stderr)
    assert (paired["n"], paired["better"], paired["worse"]) == (5, 2, 0)
    # at 256: 0, 0, +100, 0, 0
    assert result["paired"]["keydiff"]["256"]["mean"] == pytest.approx(20.0)
    assert (result["paired"]["keydiff"]["256"]["better"], result["paired"]["keydiff"]["256"]["worse"]) == (1, 0)


def test_min_full_keeps_only_tasks_the_full_cache_solves(tmp_path):
    log = tmp_path / "run.samples.jsonl"
    write_log(log)
    result = compare.compare(compare.read_logs([str(log)]), "kvp:x", min_full=30)[
        ("oneshot", "question_included", 2048)]
    assert result["tasks"] == ["easy"]
    assert result["paired"]["keydiff"]["128"]["mean"] == pytest.approx(100 / 3)
    assert result["paired"]["keydiff"]["128"]["n"] == 3


def test_max_samples_takes_the_first_complete_samples_of_each_task(tmp_path):
    log = tmp_path / "run.samples.jsonl"
    write_log(log)
    result = compare.compare(compare.read_logs([str(log)]), "kvp:x", max_samples=1)[
        ("oneshot", "question_included", 2048)]
    assert result["samples_per_task"] == {"easy": 1, "hard": 1}
    assert result["paired"]["keydiff"]["128"]["mean"] == pytest.approx(50.0)  # easy 0: +100, hard 0: 0


def test_first_sample_leaves_out_the_earlier_samples(tmp_path):
    log, out_json = tmp_path / "run.samples.jsonl", tmp_path / "cmp.json"
    write_log(log)
    assert compare.main([str(log), "--first-sample", "1", "--json", str(out_json)]) == 0
    panel = json.loads(out_json.read_text())["panels"]["oneshot/question_included/2048"]["all_tasks"]
    # complete samples from index 1: easy 1, easy 2, hard 1; kvp - keydiff at 128: 0, 0, +50
    assert panel["samples_per_task"] == {"easy": 2, "hard": 1}
    assert panel["paired"]["keydiff"]["128"]["mean"] == pytest.approx(50 / 3)


def test_tagged_logs_and_per_head_series_stay_apart(tmp_path, capsys):
    first, second = tmp_path / "a.samples.jsonl", tmp_path / "b.samples.jsonl"
    write_log(first)
    per_head = [record(t, i, KVP, b, s, kv_mode="per_head")
                for (t, i), scores in SCORES.items() for b, s in ((128, scores[1]), (256, 0))]
    with open(second, "w", encoding="utf-8") as f:
        for line in per_head:
            f.write(json.dumps(line) + "\n")
    names = {r["series"] for r in compare.read_logs([str(first), f"{second}@w0.5"])}
    assert names == {"full", "kvp:x", "keydiff", "kvp:x (per head) [w0.5]"}
    # kvp-bench records the consensus of per-head results: 0 (and its absence, in older logs) is plain "per head"
    consensus = tmp_path / "c.samples.jsonl"
    consensus.write_text("".join(json.dumps(dict(r, head_consensus=w, index=r["index"] + 10 * k)) + "\n"
                                 for k, w in enumerate((0, 0.9)) for r in per_head))
    assert {r["series"] for r in compare.read_logs([str(consensus)])} == {"kvp:x (per head)", "kvp:x (per head w=0.9)"}
    # word-level eviction (kvp-bench --evict-unit word) is a series of its own, in either mode
    words = tmp_path / "d.samples.jsonl"
    words.write_text("".join(json.dumps(dict(r, evict_unit="word")) + "\n"
                             for r in (record("easy", 0, KVP, 128, 100), record("easy", 0, KVP, 128, 0, "per_head"))))
    assert {r["series"] for r in compare.read_logs([str(words)])} == {"kvp:x (words)", "kvp:x (per head) (words)"}
    out_json = tmp_path / "cmp.json"
    assert compare.main([str(first), f"{second}@w0.5", "--json", str(out_json)]) == 0
    text = capsys.readouterr().out
    assert "| **kvp:x** |" in text and "| kvp:x (per head) [w0.5] |" in text
    assert "tasks where the full cache scores ≥ 30" in text
    saved = json.loads(out_json.read_text())
    panel = saved["panels"]["oneshot/question_included/2048"]
    # per head at 256 scores 0 everywhere; shared kvp scores 100 on the three easy samples
    assert panel["all_tasks"]["paired"]["kvp:x (per head) [w0.5]"]["256"]["mean"] == pytest.approx(60.0)
    assert panel["full_at_least"]["tasks"] == ["easy"]


def test_errors_name_the_problem(tmp_path, capsys):
    log = tmp_path / "run.samples.jsonl"
    write_log(log)
    with pytest.raises(SystemExit, match="no series 'kvp:y'"):
        compare.main([str(log), "--reference", "kvp:y"])
    with pytest.raises(SystemExit, match="no series \\['tova'\\]"):
        compare.main([str(log), "--series", "tova"])
    empty = tmp_path / "empty.samples.jsonl"
    empty.write_text("")
    with pytest.raises(SystemExit, match="no results"):
        compare.main([str(empty)])
    # a log of policy runs without the full cache, which every table pairs against
    no_full = tmp_path / "policies.samples.jsonl"
    no_full.write_text("".join(json.dumps(record(t, i, KVP, 128, s[1])) + "\n" for (t, i), s in SCORES.items()))
    assert compare.main([str(no_full)]) == 1
    assert "no full-cache result" in capsys.readouterr().err


def test_agreement_pairs_each_series_text_with_the_full_caches(tmp_path, capsys):
    # difflib's ratio is 2·M / (len(a) + len(b)), M the matched characters: "abcd" vs "abxy" matches "ab", 50.
    texts = {  # (task, index): (full, kvp@128, keydiff@128)
        ("easy", 0): ("abcd", "abcd", "abxy"),
        ("easy", 1): ("abcd", "abcd", "abcd"),
        ("hard", 0): ("wxyz", "zzzz", "wxyz"),
    }
    lines = []
    for (task, index), (full, kvp, keydiff) in texts.items():
        for policy, budget, text in (("full", None, full), (KVP, 128, kvp), ("keydiff", 128, keydiff)):
            lines.append(dict(record(task, index, policy, budget, 0), prediction=text))
    log = tmp_path / "run.samples.jsonl"
    log.write_text("".join(json.dumps(line) + "\n" for line in lines))
    records = compare.read_logs([str(log)])
    panel = ("oneshot", "question_included", 2048)
    assert "agreement" not in compare.compare(records, "kvp:x")[panel]  # only when asked for
    agreement = compare.compare(records, "kvp:x", agreement=True)[panel]["agreement"]
    # "wxyz" vs "zzzz" matches one "z": 2·1/8 = 25
    assert agreement["series"]["kvp:x"]["128"]["per_task"] == pytest.approx({"easy": 100.0, "hard": 25.0})
    assert agreement["series"]["keydiff"]["128"]["per_task"] == pytest.approx({"easy": 75.0, "hard": 100.0})
    paired = agreement["paired"]["keydiff"]["128"]  # kvp - keydiff per sample: +50, 0, -75
    assert paired["mean"] == pytest.approx(-25 / 3)
    assert (paired["n"], paired["better"], paired["worse"]) == (3, 1, 1)
    assert compare.main([str(log), "--agreement"]) == 0
    assert "Agreement with the full cache's answer" in capsys.readouterr().out
    # an older log without the generated text cannot be compared this way, and says so
    bare = tmp_path / "bare.samples.jsonl"
    bare.write_text("".join(json.dumps({k: v for k, v in line.items() if k != "prediction"}) + "\n" for line in lines))
    with pytest.raises(SystemExit, match="no generated text"):
        compare.main([str(bare), "--agreement"])


def nll_record(index, policy, budget, nll, protocol="oneshot"):
    return {"model": "m.gguf", "protocol": protocol, "variant": "continuation", "task": "ppl:chats", "length": 1024,
            "index": index, "policy": policy, "kv_mode": "shared", "budget": budget, "metric": "mean_nll",
            "score": nll}


def test_perplexity_runs_are_paired_with_lower_as_better(tmp_path, capsys):
    nll = {  # index: (full, kvp@256, streaming@256)
        0: (0.5, 0.6, 0.7),
        1: (0.5, 0.8, 0.6),
        2: (0.5, 0.55, 0.65),
    }
    lines = [nll_record(i, policy, budget, value) for i, values in nll.items()
             for policy, budget, value in zip(("full", KVP, "streaming"), (None, 256, 256), values)]
    lines.append(record("easy", 0, "full", None, 100))  # a task result of another panel in the same log
    log, out_json = tmp_path / "ppl.samples.jsonl", tmp_path / "cmp.json"
    log.write_text("".join(json.dumps(line) + "\n" for line in lines))
    result = compare.compare(compare.read_logs([str(log)]), "kvp:x", min_full=30)[("oneshot", "continuation", 1024)]
    assert result["lower_is_better"] and result["metric"] == "mean_nll"
    assert result["tasks"] == ["ppl:chats"]  # the full-cache threshold of task scores does not apply
    assert result["full"]["mean"] == pytest.approx(0.5)
    assert result["series"]["kvp:x"]["256"]["mean"] == pytest.approx(0.65)
    paired = result["paired"]["streaming"]["256"]  # kvp - streaming per chat: -0.1, +0.2, -0.1
    assert paired["mean"] == pytest.approx(0.0)
    assert paired["stderr"] == pytest.approx(math.sqrt((0.01 + 0.04 + 0.01) / 2 / 3))
    assert (paired["n"], paired["better"], paired["worse"]) == (3, 2, 1)  # lower NLL is better
    assert result["perplexity_vs_full"]["kvp:x"]["256"] == pytest.approx(math.exp(0.15) - 1)
    assert result["perplexity_vs_full"]["streaming"]["256"] == pytest.approx(math.exp(0.15) - 1)
    assert compare.main([str(log), "--agreement", "--json", str(out_json)]) == 0  # no text to agree on: skipped
    captured = capsys.readouterr()
    text = captured.out
    assert "only the full cache's results" in captured.err  # the task panel holds nothing to compare
    assert "lower is better" in text and "| **kvp:x** | 0.650 |" in text and "± 0.100 (2/1)" in text
    assert "| kvp:x | +16.2% |" in text and "tasks where the full cache" not in text
    panels = json.loads(out_json.read_text())["panels"]
    assert "full_at_least" not in panels["oneshot/continuation/1024"]
    # perplexity and task scores never share a table
    mixed = tmp_path / "mixed.samples.jsonl"
    mixed.write_text("".join(json.dumps(dict(line, variant="continuation", length=1024, task="ppl:chats")) + "\n"
                             for line in [record("x", 0, KVP, 256, 50)]) + log.read_text())
    with pytest.raises(SystemExit, match="mixes perplexity"):
        compare.main([str(mixed)])
