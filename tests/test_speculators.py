"""Medusa heads and the EAGLE-3-style head: training, losslessness, the draft tree, export.

The heads are trained here on the tiny test target with the commands users run
(`leapdecode train medusa | eagle`, a few dozen steps), so their drafts are sometimes
right and both the accept and the reject paths of tree verification run. Greedy output
must equal `transformers` `generate`; sampled output must follow the target's own
distribution (chi-square, as in test_sampling_e2e) and, seeded, equal plain sampling.
"""

import json
import os

import pytest
import torch
import torch.nn.functional as F
from safetensors.torch import load_file

import helpers
from helpers import assert_lossless
from leapdecode import LeapDecoder
from leapdecode.cli import main
from leapdecode.errors import LeapDecodeError
from leapdecode.models import HiddenRequest, load_model
from leapdecode.models.eagle import Eagle3Head
from leapdecode.models.medusa import build_tree, tree_layout

MAX_NEW = 24


@pytest.fixture(scope="module")
def heads(tmp_path_factory, target_dir):
    return helpers.train_heads(target_dir, str(tmp_path_factory.mktemp("heads")))


@pytest.fixture(scope="module")
def dec(target_dir, heads):
    return LeapDecoder.from_pretrained(target_dir, speculators=list(heads))


def test_training_writes_cards_and_resumes(heads, target_dir):
    medusa, eagle = heads
    for path, kind in ((medusa, "medusa"), (eagle, "eagle")):
        card = open(os.path.join(path, "README.md")).read()
        assert "Held-out accuracy" in card and "self-distillation" in card
        report = json.load(open(os.path.join(path, "evaluation.json")))
        assert report["kind"] == kind and report["training"]["steps"] == 60
        # the loss fell (the tiny random target is hard to predict: no accuracy bar)
        losses = [json.loads(line)["loss"] for line in open(path + "-run/log.jsonl")]
        assert sum(losses[-10:]) < sum(losses[:10])
    acc = json.load(open(os.path.join(eagle, "config.json")))["accuracy"]
    assert len(acc["top1_by_depth"]) == 3 and acc["draft_vocab_coverage"] > 0.5
    # a finished run resumes at its end: the same command again trains no further step
    log = os.path.join(medusa + "-run", "log.jsonl")
    before = len(open(log).read().splitlines())
    helpers.train_heads(target_dir, os.path.dirname(medusa))
    assert len(open(log).read().splitlines()) == before


def test_eagle_training_continues_from_a_trained_head(heads, target_dir, tmp_path, capsys):
    """`train eagle --init HEAD` starts from HEAD's weights and draft vocabulary: its first
    losses are those of a trained head, not a new one's; a head of another kind is refused."""
    medusa, eagle = heads
    out = str(tmp_path / "eagle-more")
    corpus = os.path.join(os.path.dirname(eagle), "corpus")
    argv = ["train", "eagle", "--target", target_dir, "--out", out, "--run-dir", out + "-run",
            "--data", corpus, "--val-percent", "20", "--steps", "4", "--batch", "4",
            "--context", "64", "--eval-prompts", "0", "--threads", "1", "--ttt-steps", "3",
            "--init", eagle]  # fmt: skip
    threads = torch.get_num_threads()
    try:
        assert main(argv) == 0
        capsys.readouterr()
        assert main(argv[:-1] + [medusa]) == 2  # a clear error, not a traceback
        assert "holds MedusaHeads (Medusa heads), not an EAGLE-3 head" in capsys.readouterr().err
    finally:
        torch.set_num_threads(threads)
    first = lambda run: json.loads(open(run + "/log.jsonl").readline())["loss"]  # noqa: E731
    assert first(out + "-run") < first(eagle + "-run")
    assert "continued from" in open(os.path.join(out, "README.md")).read()
    old, new = Eagle3Head.load(eagle), Eagle3Head.load(out)
    assert torch.equal(old.draft_ids, new.draft_ids)


def test_hidden_states_match_transformers(target_dir, hf_target):
    m = load_model(target_dir, "native", "cpu", "float32", what="target")
    m.allocate(2, 64)
    x = torch.randint(0, helpers.VOCAB, (2, 12))
    layers = (0, 1, 2)
    out = m.forward_outputs(x, torch.tensor([0, 1]), HiddenRequest(layers, final=True))
    with torch.no_grad():
        ref = hf_target(x, output_hidden_states=True)
    for j, i in enumerate(layers[:-1]):  # transformers' last entry is after the final norm
        torch.testing.assert_close(out.hidden[:, :, j], ref.hidden_states[i])
    torch.testing.assert_close(out.final, ref.hidden_states[-1])
    torch.testing.assert_close(out.logits, ref.logits, atol=1e-4, rtol=1e-4)
    with pytest.raises(LeapDecodeError, match="does not exist"):
        m.forward_outputs(x, torch.tensor([0, 1]), HiddenRequest((5,)))


def test_medusa_tree_is_the_best_prefix_closed_tree():
    acc = [[0.5, 0.2, 0.1], [0.4, 0.1, 0.05], [0.3, 0.0, 0.1]]  # noise: rank 2 > rank 1
    tree = build_tree(acc, size=64)
    acc[2] = [0.3, 0.1, 0.0]  # what the tree assumes: accuracy falls with rank
    value = {}
    for path in tree:
        v = 1.0
        for depth, r in enumerate(path):
            v *= acc[depth][r]
        value[path] = v
        assert len(path) == 1 or path[:-1] in value  # its parent came first
    values = [value[p] for p in tree]
    assert values == sorted(values, reverse=True)
    # every path with a positive value is there (3 + 3 x 3 + 9 x 2 of them)
    assert len(tree) == 3 + 9 + 18
    heads, ranks, parents = tree_layout(tree, 5)
    assert heads[0] == 0 and ranks[0] == 0 and parents[0] == 0
    assert all(p <= i for i, p in enumerate(parents))


@pytest.mark.parametrize("backlog", [256, 3])
def test_eagle_chain_matches_a_plain_recomputation(dec, hf_target, monkeypatch, backlog):
    """With top_k = 1 the tree is the head's greedy chain. Recompute it from scratch (the
    target's features for the whole sequence, the head without any cache) at several
    steps of a generation: the proposer's incremental cache must give the same chain.
    backlog 3: features are fed as they come, not with the proposal (as for a sequence
    that gets k = 0 for a while), and the proposal drafts from the kept root."""
    import leapdecode.proposers.eagle as eagle_mod

    monkeypatch.setattr(eagle_mod, "BACKLOG", backlog)
    prop = dec.engine.proposers["eagle"]
    head: Eagle3Head = prop.head
    seen = []
    grow = prop._grow

    def spy(seqs, budgets, top_k, depth):
        trees = grow(seqs, budgets, top_k, depth)
        seen.append((list(seqs[0].tokens), trees[0]))
        return trees

    prop._grow = spy
    try:
        dec.generate(list(range(5, 30)), method="eagle", k=3, max_new_tokens=20,
                     speculative_num_steps=3, speculative_eagle_topk=1)  # fmt: skip
    finally:
        prop._grow = grow
    assert len(seen) >= 3
    embed = hf_target.get_input_embeddings()
    for tokens, (draft, parents) in seen:
        assert parents == list(range(len(draft)))  # a chain
        with torch.no_grad():
            hs = hf_target(torch.tensor([tokens[:-1]]), output_hidden_states=True).hidden_states
            aux = torch.stack([hs[i] for i in head.aux_layers], dim=2)  # [1, n-1, 3, H]
            n = aux.shape[1]
            g = head.combine(aux)
            pos = torch.arange(1, n + 1)[None]
            q, k, v = head.qkv(g, embed(torch.tensor([tokens[1:]])), pos)
            mask = torch.ones(n, n, dtype=torch.bool).tril()
            o, logits = head.finish(g, q, k, v, mask)
            chain, feat = [], o[:, -1:]
            tok = int(head.draft_ids[logits[0, -1].argmax()])
            for d in range(len(draft)):
                chain.append(tok)
                if d + 1 == len(draft):
                    break
                q1, k1, v1 = head.qkv(feat, embed(torch.tensor([[tok]])), pos[:, -1:] + d + 1)
                k, v = torch.cat([k, k1], 2), torch.cat([v, v1], 2)
                feat, lg = head.finish(feat, q1, k, v, None)
                tok = int(head.draft_ids[lg[0, -1].argmax()])
        assert chain == draft


@pytest.fixture(scope="module")
def prompts(dec):
    return helpers.random_prompts(dec.tokenizer, 30, 3, 50, seed=2)


@pytest.fixture(scope="module")
def reference(prompts, hf_target):
    return helpers.greedy_reference(hf_target, prompts, MAX_NEW)


@pytest.mark.parametrize("method,kw", [("medusa", {}), ("eagle", {}),
                                       ("eagle", {"speculative_num_steps": 2,
                                                  "speculative_eagle_topk": 6})])  # fmt: skip
@pytest.mark.parametrize("k", [1, 4, 16])
def test_greedy_matches_transformers_generate(dec, prompts, reference, hf_target, method, kw, k):
    results = dec.generate_batch(prompts, method=method, k=k, max_new_tokens=MAX_NEW, **kw)
    assert_lossless(prompts, [r.token_ids for r in results], reference, hf_target)
    proposed = sum(r.stats.proposed for r in results)
    accepted = sum(r.stats.accepted for r in results)
    assert 0 < accepted < proposed


def test_mixed_methods_share_steps(dec, prompts, reference, hf_target):
    """Requests of different methods decode in the same steps (only some want hidden
    states); each keeps its own output."""
    methods = ("medusa", "eagle", "none", "ngram")
    seqs = [dec.request(p, method=methods[i % 4], k=8, max_new_tokens=MAX_NEW)
            for i, p in enumerate(prompts[:12])]  # fmt: skip
    for _ in dec._run(seqs):
        pass
    assert_lossless(prompts[:12], [s.output for s in seqs], reference[:12], hf_target)
    outs = [dec.generate(p, method="eagle", k=8, max_new_tokens=MAX_NEW).token_ids
            for p in prompts[:4]]  # one at a time  # fmt: skip
    assert_lossless(prompts[:4], outs, reference[:4], hf_target)


def test_each_request_keeps_its_own_eagle_tree_shape(dec, prompts, reference, hf_target):
    prop = dec.engine.proposers["eagle"]
    grow, shapes = prop._grow, []

    def spy(seqs, budgets, top_k, depth):
        shapes.append((len(seqs), top_k, depth))
        return grow(seqs, budgets, top_k, depth)

    prop._grow = spy
    try:
        seqs = [dec.request(p, method="eagle", k=8, max_new_tokens=MAX_NEW,
                            speculative_num_steps=1 + i % 2 * 3,
                            speculative_eagle_topk=1 + i % 2 * 3)
                for i, p in enumerate(prompts[:6])]  # fmt: skip
        for _ in dec._run(seqs):
            pass
    finally:
        prop._grow = grow
    assert shapes[0] == (3, 1, 1) and shapes[1] == (3, 4, 4)
    assert_lossless(prompts[:6], [s.output for s in seqs], reference[:6], hf_target)


@pytest.mark.parametrize("head", ["medusa", "eagle"])
def test_auto_may_pick_the_heads_and_stays_lossless(dec, prompts, reference, hf_target, head,
                                                    monkeypatch):  # fmt: skip
    """auto weighs the heads' trees against n-grams, suffix and no drafts, step by step;
    whatever it picks, the output is the target's. The tiny target's heads are poor and
    an eagle step costs as much as its 2-layer target, so here the head under test starts
    with a high acceptance prior (as if it had been good so far), the other with none, and
    eagle's head steps are free."""
    sched = dec.engine.planner
    from leapdecode.engine.planner import _Estimate

    propose_s = sched._propose_s
    monkeypatch.setattr(
        sched, "_propose_s", lambda c, m, s: 0.0 if m == "eagle" else propose_s(c, m, s)
    )
    prior = {m: e.copy() for m, e in sched.global_rate.items()}
    sched.global_rate.update(
        {("medusa", 0): _Estimate.flat(0.0), ("eagle", 0): _Estimate.flat(0.0)}
    )
    sched.global_rate[(head, 0)] = good = _Estimate.flat(0.99)
    good.seen[:] = 1000  # a long record: a few poor outcomes do not undo it

    try:
        with helpers.planned_methods(sched) as used:
            results = dec.generate_batch(
                prompts,
                method="auto",
                k=4,
                max_new_tokens=MAX_NEW,
                auto_methods=("ngram", "suffix", "medusa", "eagle"),
            )
    finally:
        sched.global_rate.clear()
        sched.global_rate.update(prior)
    assert_lossless(prompts, [r.token_ids for r in results], reference, hf_target)
    assert head in used, set(used)


def test_eagle_feeds_no_features_of_a_request_that_stopped(dec, monkeypatch):
    """A request that stops (a stop token, a stop string) inside an accepted path keeps
    fewer tokens than the target produced features for; the proposer must not feed those
    (regression: a shape error inside engine.step once the backlog was fed)."""
    import leapdecode.proposers.eagle as eagle_mod

    monkeypatch.setattr(eagle_mod, "BACKLOG", 0)  # fed at once, as a long backlog would be
    prop = dec.engine.proposers["eagle"]
    head: Eagle3Head = prop.head
    seq = dec.request(list(range(5, 30)), method="eagle", max_new_tokens=8)
    seq.slot = 0
    prop.add([seq])
    seq.append([40])  # the prefill's token
    seq.finished = True  # say the next step's accepted path held a stop token at once
    feats = torch.randn(25 + 3, len(head.aux_layers), head.target_hidden)  # prompt + 3 accepted
    prop.target_hidden([seq], [feats], [None])
    assert not prop.pending[seq.id] and seq.id not in prop.root
    prop.remove([seq])


def test_a_broken_heads_folder_beside_the_target_is_skipped(target_dir, tmp_path, heads, caplog):
    """Heads beside a target load by themselves, so a broken one (a killed write, a bad
    config) must not stop the other methods; given explicitly, it is a clear error."""
    import shutil

    target = tmp_path / "t"
    target.symlink_to(target_dir)
    shutil.copytree(heads[1], tmp_path / "t-eagle")
    weights = tmp_path / "t-eagle" / "model.safetensors"
    weights.write_bytes(weights.read_bytes()[:1000])  # truncated
    (tmp_path / "t-medusa").mkdir()
    (tmp_path / "t-medusa" / "config.json").write_text("{not json")
    with caplog.at_level("WARNING", logger="leapdecode"):
        dec = LeapDecoder.from_pretrained(str(target))
    assert "eagle" not in dec.engine.proposers and "medusa" not in dec.engine.proposers
    assert "not loading" in caplog.text and "t-eagle" in caplog.text
    assert dec.generate("def f(x):", method="ngram", max_new_tokens=4).token_ids
    for path in ("t-eagle", "t-medusa"):
        with pytest.raises(LeapDecodeError, match="retrain|could not be read"):
            LeapDecoder.from_pretrained(target_dir, speculators=[str(tmp_path / path)])


def test_errors_say_what_to_do(target_dir, tmp_path, heads):
    bare = LeapDecoder.from_pretrained(target_dir, speculators=[])
    with pytest.raises(LeapDecodeError, match="--speculator"):
        bare.generate("def f():", method="eagle")
    # the other kind loaded: the message says which one is, not only "pass --speculator"
    only_eagle = LeapDecoder.from_pretrained(target_dir, speculators=[heads[1]])
    with pytest.raises(LeapDecodeError, match=r"needs Medusa heads.*\(only eagle\)"):
        only_eagle.generate("def f():", method="medusa")
    with pytest.raises(LeapDecodeError, match="holds an EAGLE head, not a language model"):
        LeapDecoder.from_pretrained(target_dir, draft=heads[1])  # a head passed as the draft
    # the transformers backend with heads beside the target: the real reason, not a hint
    hf = LeapDecoder.from_pretrained(target_dir, backend="transformers")
    with pytest.raises(LeapDecodeError, match="transformers backend lacks: use --backend native"):
        hf.generate("def f():", method="eagle")
    with pytest.raises(LeapDecodeError, match="backend native"):
        LeapDecoder.from_pretrained(target_dir, backend="transformers", speculators=[heads[0]])
    with pytest.raises(LeapDecodeError, match="train medusa"):
        LeapDecoder.from_pretrained(target_dir, speculators=[str(tmp_path)])
    with pytest.raises(LeapDecodeError, match="speculative_num_steps"):
        bare.request("x", method="eagle", speculative_num_steps=0)
    # a run folder of another head kind or settings is refused, not silently resumed
    argv = ["train", "medusa", "--target", target_dir, "--out", str(tmp_path / "m"),
            "--run-dir", heads[0] + "-run", "--heads", "2", "--steps", "60", "--batch", "4",
            "--context", "64", "--eval-prompts", "0", "--data", os.path.dirname(heads[0])
            + "/corpus", "--val-percent", "20"]  # fmt: skip
    threads = torch.get_num_threads()
    try:
        assert main(argv) == 2
    finally:
        torch.set_num_threads(threads)


# --------------------------------------------------------------------------- export


# The speculators (vLLM) layout, as docs/export.md documents it: name -> shape, from
# H (head hidden), T (target hidden), heads x D, I, Vd (draft vocab) and V (target vocab).
def documented_tensors(H, T, nh, nkv, D, I, Vd, V):  # noqa: E741
    return {
        "fc.weight": (H, 3 * T),
        "layers.0.self_attn.q_proj.weight": (nh * D, 2 * H),
        "layers.0.self_attn.k_proj.weight": (nkv * D, 2 * H),
        "layers.0.self_attn.v_proj.weight": (nkv * D, 2 * H),
        "layers.0.self_attn.o_proj.weight": (H, nh * D),
        "layers.0.input_layernorm.weight": (H,),
        "layers.0.hidden_norm.weight": (H,),
        "layers.0.post_attention_layernorm.weight": (H,),
        "layers.0.mlp.gate_proj.weight": (I, H),
        "layers.0.mlp.up_proj.weight": (I, H),
        "layers.0.mlp.down_proj.weight": (H, I),
        "norm.weight": (H,),
        "lm_head.weight": (Vd, H),
        "d2t": (Vd,),
        "t2d": (V,),
        "embed_tokens.weight": (V, H),
    }


def _rms(x, w, eps):
    return w * (x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + eps))


def test_export_refuses_a_head_vllm_cannot_run(heads, target_dir, tmp_path, capsys):
    # the 2-layer test target leaves one distinct aux layer; vLLM's EAGLE-3 reads three
    assert main(["export", "--speculator", heads[1], "--target", target_dir,
                 "--out", str(tmp_path / "x")]) == 2  # fmt: skip
    assert "three distinct target layers" in capsys.readouterr().err


def test_export_matches_the_documented_schema_and_computes_the_same(tmp_path, tok_dir):
    from leapdecode.train.eagle import new_head
    from leapdecode.train.teacher import Teacher

    target_dir = str(tmp_path / "target4")
    helpers.make_llama(target_dir, seed=5, tokenizer_dir=tok_dir, num_hidden_layers=4)
    head_dir = str(tmp_path / "target4-eagle")
    new_head(Teacher(target_dir), torch.arange(0, helpers.VOCAB, 3)).save(head_dir)
    out = str(tmp_path / "export")
    assert main(["export", "--format", "speculators", "--speculator", head_dir, "--target",
                 target_dir, "--out", out, "--dtype", "float32"]) == 0  # fmt: skip
    # the weights are as readable as the config (safetensors alone writes them 0600)
    mode = os.stat(os.path.join(out, "model.safetensors")).st_mode & 0o777
    assert mode == os.stat(os.path.join(out, "config.json")).st_mode & 0o777
    # a folder that cannot be written is a clear error, not an internal one
    blocked = tmp_path / "a-file"
    blocked.write_text("")
    assert main(["export", "--speculator", head_dir, "--target", target_dir,
                 "--out", str(blocked / "sub")]) == 2  # fmt: skip
    (tmp_path / "taken" / "model.safetensors").mkdir(parents=True)  # safetensors' own error
    assert main(["export", "--speculator", head_dir, "--target", target_dir,
                 "--out", str(tmp_path / "taken")]) == 2  # fmt: skip
    cfg = json.load(open(os.path.join(out, "config.json")))
    assert cfg["speculators_model_type"] == "eagle3"
    assert cfg["architectures"] == ["Eagle3Speculator"]
    layer = cfg["transformer_layer_config"]
    assert layer["num_hidden_layers"] == 1 and layer["model_type"] == "llama"
    sc = cfg["speculators_config"]
    assert sc["algorithm"] == "eagle3" and sc["default_proposal_method"] == "greedy"
    assert sc["proposal_methods"][0]["proposal_type"] == "greedy"
    assert sc["proposal_methods"][0]["speculative_tokens"] >= 1
    assert sc["verifier"]["name_or_path"] and sc["verifier"]["architectures"]
    head = Eagle3Head.load(head_dir)
    assert cfg["eagle_aux_hidden_state_layer_ids"] == [1, 2, 3]
    assert cfg["draft_vocab_size"] == head.draft_vocab_size
    assert cfg["target_hidden_size"] == head.target_hidden
    assert cfg["eagle_aux_hidden_state_layer_ids"] == list(head.aux_layers)
    assert cfg["norm_before_residual"] is False
    t = load_file(os.path.join(out, "model.safetensors"))
    want = documented_tensors(layer["hidden_size"], cfg["target_hidden_size"],
                              layer["num_attention_heads"], layer["num_key_value_heads"],
                              layer["head_dim"], layer["intermediate_size"],
                              cfg["draft_vocab_size"], layer["vocab_size"])  # fmt: skip
    assert {n: tuple(v.shape) for n, v in t.items()} == want
    assert t["d2t"].dtype == torch.int64 and t["t2d"].dtype == torch.bool
    assert int(t["t2d"].sum()) == cfg["draft_vocab_size"]
    ids = torch.arange(cfg["draft_vocab_size"]) + t["d2t"]  # target id = draft id + d2t
    assert torch.equal(ids, head.draft_ids) and bool(t["t2d"][ids].all())

    # vLLM's Eagle3 layer (norm_before_residual false), written from the documented
    # computation over the exported tensors, gives our head's logits
    torch.manual_seed(0)
    n, eps = 7, layer["rms_norm_eps"]
    aux = torch.randn(1, n, 3, cfg["target_hidden_size"])
    ids_in = torch.randint(0, layer["vocab_size"], (1, n))
    pos = torch.arange(1, n + 1)[None]
    with torch.no_grad():
        g = head.combine(aux)
        q, k, v = head.qkv(g, t["embed_tokens.weight"][ids_in], pos)
        _, ours = head.finish(g, q, k, v, torch.ones(n, n, dtype=torch.bool).tril())
        h = aux.flatten(-2) @ t["fc.weight"].T
        e = _rms(t["embed_tokens.weight"][ids_in], t["layers.0.input_layernorm.weight"], eps)
        x = torch.cat([e, _rms(h, t["layers.0.hidden_norm.weight"], eps)], -1)
        nh, nkv, d = layer["num_attention_heads"], layer["num_key_value_heads"], layer["head_dim"]
        qv = (x @ t["layers.0.self_attn.q_proj.weight"].T).view(1, n, nh, d)
        kv = (x @ t["layers.0.self_attn.k_proj.weight"].T).view(1, n, nkv, d)
        vv = (x @ t["layers.0.self_attn.v_proj.weight"].T).view(1, n, nkv, d)
        cos, sin = head.cos[pos][:, :, None], head.sin[pos][:, :, None]
        rot = lambda z: z * cos + torch.roll(z, d // 2, -1) * sin  # noqa: E731
        a = F.scaled_dot_product_attention(rot(qv).transpose(1, 2), rot(kv).transpose(1, 2),
                                           vv.transpose(1, 2), is_causal=True,
                                           enable_gqa=nh != nkv)  # fmt: skip
        r = h + a.transpose(1, 2).reshape(1, n, nh * d) @ t["layers.0.self_attn.o_proj.weight"].T
        m = _rms(r, t["layers.0.post_attention_layernorm.weight"], eps)
        mlp = (
            F.silu(m @ t["layers.0.mlp.gate_proj.weight"].T)
            * (m @ t["layers.0.mlp.up_proj.weight"].T)
        ) @ t["layers.0.mlp.down_proj.weight"].T
        theirs = _rms(r + mlp, t["norm.weight"], eps) @ t["lm_head.weight"].T
    torch.testing.assert_close(ours, theirs, atol=1e-4, rtol=1e-4)
