"""The engine as a service: continuous batching, per-sequence k, seeded rows, `auto`."""

import itertools

import numpy as np
import pytest
import torch

import helpers
from helpers import assert_lossless
from leapdecode import LeapDecodeError, SpecConfig
from leapdecode.engine import CostModel

MAX_NEW = 24


@pytest.fixture(scope="module")
def prompts(decoder):
    return helpers.random_prompts(decoder.tokenizer, 16, 4, 50, seed=1)


@pytest.fixture(scope="module")
def reference(prompts, hf_target):
    return helpers.greedy_reference(hf_target, prompts, MAX_NEW)


@pytest.mark.parametrize("method", ["none", "draft", "ngram", "auto"])
def test_greedy_alone_equals_batched_with_15_others(decoder, prompts, reference, hf_target, method):
    alone = [decoder.generate(prompts[0], method=method, max_new_tokens=MAX_NEW).token_ids]
    batched = decoder.generate_batch(prompts, method=method, max_new_tokens=MAX_NEW)
    assert_lossless(prompts[:1], alone, reference[:1], hf_target)
    assert_lossless(prompts, [r.token_ids for r in batched], reference, hf_target)
    assert batched[0].token_ids == alone[0]


def test_requests_join_and_leave_between_steps(decoder, prompts, reference, hf_target):
    """Requests added while others run (continuous batching) still give the target's tokens."""
    engine = decoder.engine
    seqs = [decoder.request(p, method=m, max_new_tokens=MAX_NEW)
            for p, m in zip(prompts, ["draft", "ngram", "none", "auto"] * 4, strict=True)]  # fmt: skip
    pending = list(seqs)
    steps = 0
    while pending or engine.has_unfinished():
        if pending and steps % 3 == 0:  # a newcomer every third step
            engine.add_request(pending.pop(0))
        engine.step()
        steps += 1
    assert all(s.finished for s in seqs)
    assert_lossless(prompts, [s.output for s in seqs], reference, hf_target)
    assert sorted(engine.free_slots) == list(range(engine.max_num_seqs))


@pytest.mark.parametrize("method", ["none", "draft", "ngram"])
def test_seeded_rows_reproduce_alone_and_batched(decoder, prompts, method):
    opts = dict(method=method, k=3, max_new_tokens=MAX_NEW, temperature=1.3, top_k=40, seed=7)
    batch = decoder.generate_batch(prompts[:6], **opts)
    again = decoder.generate_batch(prompts[:6], **opts)
    assert [r.token_ids for r in batch] == [r.token_ids for r in again]
    for i in (0, 3, 5):  # row i of a seeded batch is the single run with seed + i
        single = decoder.generate(prompts[i], **{**opts, "seed": 7 + i})
        assert single.token_ids == batch[i].token_ids


def test_abort_frees_the_slot(decoder, prompts):
    engine = decoder.engine
    seq = decoder.request(prompts[0], max_new_tokens=MAX_NEW)
    engine.add_request(seq)
    engine.step()
    assert seq.slot in [s.slot for s in engine.running]
    assert engine.abort(seq.id) is seq and seq.finish_reason == "abort"
    assert not engine.has_unfinished()
    assert sorted(engine.free_slots) == list(range(engine.max_num_seqs))
    assert engine.abort(seq.id) is None  # already gone


def test_spec_config_is_validated_once():
    assert SpecConfig(method="none", num_speculative_tokens=8).k == 0
    assert SpecConfig(method="ngram").with_overrides(k=9).num_speculative_tokens == 9
    for bad in (dict(method="magic"), dict(num_speculative_tokens=65),
                dict(prompt_lookup_min=3, prompt_lookup_max=2), dict(draft_min_prob=1.0)):  # fmt: skip
        with pytest.raises(LeapDecodeError):
            SpecConfig(**bad)


def _plan(decoder, prompts, cost):
    """auto's plan for 8 running sequences under a given cost model."""
    engine = decoder.engine
    seqs = [decoder.request(p * 3, method="auto", k=4, max_new_tokens=8) for p in prompts[:8]]
    for s in seqs:
        engine.add_request(s)
    engine.step()  # prefill: all are running now
    old, engine.planner.cost = engine.planner.cost, cost
    try:
        return engine.planner.plan(seqs)
    finally:
        engine.planner.cost = old
        for s in seqs:
            engine.abort(s.id)


def test_auto_speculates_when_rows_are_cheap_and_not_when_dear(decoder, prompts):
    # repeated prompts: n-gram drafts are available for every sequence
    # per batch size 1 and 8, per 1 / 2 new tokens a sequence: seconds
    cheap = CostModel((1, 8), (1, 2), ((0.01, 0.0101), (0.02, 0.0208)), (0.0005, 0.0006))
    dear = CostModel((1, 8), (1, 2), ((0.01, 0.02), (0.02, 0.04)), (0.01, 0.02))  # rows add up
    assert all(k > 0 for _, k in _plan(decoder, prompts, cheap))
    assert all(k == 0 for _, k in _plan(decoder, prompts, dear))


def test_auto_scores_the_free_chains_it_did_not_draft(decoder):
    """The chains n-gram and suffix offered an auto request, and auto did not verify, are
    scored against the tokens the step emitted: hits up to the first miss, the positions
    past the emitted tokens untried."""
    seq = decoder.request([1, 2, 3, 4], method="auto", max_new_tokens=8)
    sched = decoder.engine.planner
    before = sched._global("ngram", 3).prior().rates.copy()  # the request's starting estimate
    chains = {"ngram": ([5, 6, 7, 8], 3), "suffix": ([5, 6], 2)}  # (chain, bucket)
    sched.shadow[seq.id] = (len(seq.tokens), chains)
    seq.append([5, 6, 9])  # the step emitted three tokens
    sched._shadow_outcomes(seq, "suffix")  # suffix was drafted: its real outcome counts
    ngram = sched.estimates[(seq.id, "ngram", 3)]
    assert ngram.seen[1:5].tolist() == [1, 1, 1, 0]  # 5, 6 hit, 7 missed, 8 untried
    assert ngram.rates[1] > before[1] and ngram.rates[3] < before[3]
    assert not any(key[:2] == (seq.id, "suffix") for key in sched.estimates)
    assert seq.id not in sched.shadow
    sched.forget([seq])


def test_draft_catch_up_is_charged_over_the_draft_steps_auto_takes(decoder, prompts):
    """auto learns how often it drafts with the draft model for rows the draft has fed:
    a prompt's catch-up is spread over that share of the steps a row has left."""
    from leapdecode.engine import planner as sched_mod

    sched, draft = decoder.engine.planner, decoder.engine.proposers["draft"]
    seqs = [decoder.request(p, method="auto", k=4, max_new_tokens=8) for p in prompts[:3]]
    saved = sched.draft_share
    try:
        sched.draft_share = sched_mod.DRAFT_SHARE_PRIOR
        sched._learn_draft_share(seqs, [("draft", 2)] * 3)  # none fed yet: nothing learnt
        assert sched.draft_share == sched_mod.DRAFT_SHARE_PRIOR
        for s in seqs:
            draft.fed[s.id] = len(s.tokens)
        for _ in range(100):  # fed, and n-grams win their steps
            sched._learn_draft_share(seqs, [("ngram", 8), ("ngram", 8), ("draft", 0)])
        assert sched.draft_share < 0.01
        for _ in range(100):
            sched._learn_draft_share(seqs, [("draft", 2), ("ngram", 8), ("draft", 3)])
        assert sched.draft_share == pytest.approx(2 / 3, abs=0.01)
    finally:
        sched.draft_share = saved
        for s in seqs:
            draft.fed.pop(s.id, None)


def test_cost_model_profile_is_positive_and_leaves_caches_empty(decoder):
    engine = decoder.engine
    engine.allocate()
    cost = CostModel.profile(engine.target, engine.draft, 4, reps=1)
    assert cost.verify_s(4, 12) > 0 and cost.draft_s(4) > 0
    assert int(engine.target.lengths(torch.arange(4)).sum()) == 0
    # a short and a long cached prefix, both inside the context; never cheaper when longer
    assert len(cost.contexts) == 2 and cost.contexts[-1] < engine.target.max_context
    assert (cost.verify[1] >= cost.verify[0]).all()


def test_cost_model_prices_the_batchs_longest_prefix():
    """Every row of a verify forward attends over the batch's longest cached prefix."""
    short = ((0.01, 0.012, 0.016), (0.02, 0.024, 0.032))  # [batch 1, 8] x [T 1, 2, 4]
    long = ((0.012, 0.016, 0.024), (0.024, 0.032, 0.048))
    cost = CostModel((1, 8), (1, 2, 4), (short, long), (0.001, 0.002), contexts=(256, 768))
    assert cost.verify_s(8, 32) == pytest.approx(0.032)  # no context: the short profile
    assert cost.verify_s(8, 32, 100) == pytest.approx(0.032)
    assert cost.verify_s(8, 32, 512) == pytest.approx(0.040)  # halfway
    assert cost.verify_s(8, 32, 1024) == pytest.approx(0.056)  # extrapolated
    curve = cost.verify_curve(8, 40, 640)
    assert curve == pytest.approx([cost.verify_s(8, r, 640) for r in range(41)])
    with pytest.raises(ValueError, match="grid"):
        CostModel((1, 8), (1, 2, 4), (short, long), (0.001, 0.002))  # one context named


def test_draft_catch_up_of_a_newcomer_beside_a_long_sequence(decoder):
    """A newcomer's whole prompt fed to the draft beside a sequence near the end of its
    context: one right-padded forward would run the long one past the cache (found in `bench
    serve` at concurrency 12), so the catch-up splits into groups that fit."""
    from leapdecode.proposers.draft_model import fit_groups

    assert fit_groups([0, 300], [100, 2], 321) == [[0], [1]]
    assert fit_groups([5, 10, 300], [100, 3, 2], 321) == [[0, 1], [2]]
    assert fit_groups([5, 10], [100, 3], None) == [[0, 1]]

    long_prompt, newcomer = helpers.random_prompts(decoder.tokenizer, 2, 100, 101, seed=5)
    long_prompt = (long_prompt * 3)[:215]  # 215 of the model's 256 positions
    alone = [decoder.generate(p, method="draft", k=4, max_new_tokens=30).token_ids
             for p in (long_prompt, newcomer)]  # fmt: skip
    engine = decoder.engine
    a = decoder.request(long_prompt, method="draft", k=4, max_new_tokens=30)
    engine.add_request(a)
    while len(a.output) < 14:
        engine.step()
    b = decoder.request(newcomer, method="draft", k=4, max_new_tokens=30)
    engine.add_request(b)
    while engine.has_unfinished():
        engine.step()
    assert [a.output, b.output] == alone


def test_acceptance_is_estimated_by_draft_position():
    """Copied spans are all-or-nothing: a draft that survives its first token tends to
    survive the rest. Estimates by position see it; one flat rate would not."""
    from leapdecode.engine.planner import _Estimate

    est = _Estimate.flat(0.5)
    for i in range(200):  # half the drafts fail at once, half are accepted whole
        est.update(8, 0 if i % 2 else 8)
    assert 0.3 < est.rates[1] < 0.7
    assert (est.rates[2:9] > 0.95).all()
    assert est.rates[9] == 0.5  # never tried: the prior
    flat = _Estimate.flat(float(est.rates[1]))
    assert est.gains(8)[-1] > 2 * flat.gains(8)[-1]


def test_the_global_estimate_is_a_running_mean_until_it_has_evidence():
    """Across requests a position's rate is the mean of its outcomes, the starting guess
    counting as GLOBAL_PSEUDO of them, until the EMA's weight takes over: a rarely tried
    deep position is not held near the guess (0.98^40 = 45% of it after 40 outcomes)."""
    from leapdecode.engine.planner import GLOBAL_EMA, GLOBAL_PSEUDO, _Estimate

    est, ema = _Estimate.flat(0.5), _Estimate.flat(0.5)
    for i in range(40):  # position 1 accepted 3 times in 4, and then the rest always
        accepted = 0 if i % 4 == 0 else 8
        est.update(8, accepted, GLOBAL_EMA, GLOBAL_PSEUDO)
        ema.update(8, accepted, GLOBAL_EMA)
    hits, tries = 30, 40  # position 1; positions 2-8: 30 of 30
    mean = (0.5 * GLOBAL_PSEUDO + hits) / (tries + GLOBAL_PSEUDO)
    assert est.rates[1] == pytest.approx(mean)
    assert est.rates[5] == pytest.approx((0.5 * GLOBAL_PSEUDO + 30) / (30 + GLOBAL_PSEUDO))
    assert ema.rates[5] < 0.8 < est.rates[5]
    assert est.rates[9] == 0.5  # never tried
    for _ in range(2000):  # then an EMA: a change of behaviour is followed, not averaged away
        est.update(8, 0, GLOBAL_EMA, GLOBAL_PSEUDO)
    assert est.rates[1] < 0.01


def test_cost_model_curve_and_learnt_step_costs():
    cost = CostModel((1, 8), (1, 2, 4), ((0.01, 0.011, 0.013), (0.02, 0.024, 0.03)), (0.001, 0.002))
    curve = cost.verify_curve(3, 40)
    assert curve == pytest.approx([cost.verify_s(3, r) for r in range(41)])
    assert cost.propose_s("eagle", 0.5) == 0.5  # modelled until measured
    cost.observe_step({"eagle": 0.01}, 0.002)
    cost.observe_step({"eagle": 0.03}, 0.004)
    assert cost.propose_s("eagle", 0.5) == pytest.approx(0.012)
    assert cost.overhead_s == pytest.approx(0.0022)


def test_cost_model_learns_the_shape_of_the_served_costs():
    """Served forwards need not keep the profile's shape: here short drafts cost 0.8x what
    the table says and long ones 1.1x (times a level of 1.5). One factor would misprice
    both; the per-(B, T) correction learns each, and the curve keeps agreeing with verify_s."""
    import numpy as np

    table = ((0.01, 0.011, 0.013, 0.02, 0.03), (0.02, 0.024, 0.03, 0.04, 0.06),
             (0.03, 0.035, 0.045, 0.06, 0.09))  # fmt: skip
    cost = CostModel((1, 8, 16), (1, 2, 4, 8, 16), table, (0.001, 0.002, 0.003))
    served = {t: 1.5 * cost.verify_s(16, 16 * t) * (0.8 if t <= 5 else 1.1) for t in (5, 9, 17)}
    for t in [5, 9, 17] * 200:
        cost.observe(16, 16 * t, served[t], 0, 0, 0.0)
    for t, seconds in served.items():
        assert cost.verify_s(16, 16 * t) == pytest.approx(seconds, rel=0.03)
    assert cost.verify_s(1, 4) == pytest.approx(cost.verify_scale * 0.013)  # not seen: level only
    curve = cost.verify_curve(16, 16 * 20)
    assert curve == pytest.approx([cost.verify_s(16, r) for r in range(16 * 20 + 1)])
    assert np.isfinite(cost.as_dict()["verify_shape"]).all()


def test_auto_methods_limit_what_auto_picks(decoder, prompts):
    """auto_methods: auto chooses only from these (eagle is opt-in); bad values are a
    clear error."""
    sched = decoder.engine.planner
    with helpers.planned_methods(sched) as used:
        decoder.generate_batch([p * 3 for p in prompts[:4]], method="auto", k=4,
                               max_new_tokens=12, auto_methods=["suffix"])  # fmt: skip
    assert set(used) <= {"suffix"}  # (whether it drafts at all depends on what it has learnt)
    seq = decoder.request(prompts[0] * 3, method="auto", k=4, max_new_tokens=8,
                          auto_methods=["suffix"])  # fmt: skip
    decoder.engine.add_request(seq)
    decoder.engine.step()  # prefill
    try:
        assert [o[0] for o in sched._options(seq)] == ["suffix"]  # a repeated prompt matches
    finally:
        decoder.engine.abort(seq.id)
    assert SpecConfig(method="auto").auto_methods == ("ngram", "suffix", "draft")
    assert SpecConfig(method="auto", auto_methods="ngram, eagle").may_use("eagle")
    assert not SpecConfig(method="auto").may_use("eagle")
    assert not SpecConfig(method="auto").may_use("medusa")
    with pytest.raises(LeapDecodeError, match="auto_methods"):
        SpecConfig(method="auto", auto_methods=["ngram", "lookahead"])


def test_a_new_request_takes_the_deepest_evidence_for_depths_not_drafted_yet():
    """Fixed k = 2 requests teach positions 1-2 only; a new auto request's estimate for
    positions 3+ leans on position 2, not on the flat prior."""
    from leapdecode.engine.planner import _Estimate

    glob = _Estimate.flat(0.6)
    for i in range(300):
        glob.update(2, (0, 1, 2, 2)[i % 4], weight=0.02)
    new = glob.prior()
    assert new.rates[3] == pytest.approx(new.rates[2]) and new.rates[3] != 0.6
    assert new.rates[1] == pytest.approx(glob.rates[1])


def test_auto_keeps_short_and_long_matches_apart(decoder):
    """auto's estimates are kept by the kind of draft on offer (Offer.bucket): misses of
    the one-token suffix drafts it is offered where n-grams find nothing do not lower what
    it expects of a 16-token suffix match, nor the other way round."""
    proposers = decoder.engine.proposers
    suffix = proposers["suffix"]
    assert [suffix.bucket_at(n) for n in (1, 2, 3, 4, 5, 8, 9, 16)] == [1, 2, 3, 3, 4, 4, 5, 5]
    seq = decoder.request([5, 6, 7, 1, 2, 3, 4, 9, 1, 2, 3], method="auto", max_new_tokens=8)
    proposers["ngram"].add([seq])
    try:  # the n-gram offer's bucket: the size of the n-gram it matched
        assert proposers["ngram"].offer(seq, 8).bucket == 3
    finally:
        proposers["ngram"].remove([seq])
    sched = decoder.engine.planner
    long_before = sched._global("suffix", 5).rates.copy()
    for _ in range(5):
        sched.shadow[seq.id] = (len(seq.tokens), {"suffix": ([7], 1)})
        seq.append([9])
        sched._shadow_outcomes(seq, None)
    assert sched.estimates[(seq.id, "suffix", 1)].rates[1] < suffix.prior / 2
    assert (sched._global("suffix", 5).rates == long_before).all()
    assert (seq.id, "suffix", 5) not in sched.estimates
    sched.forget([seq])
    assert not any(key[0] == seq.id for key in sched.estimates)


def test_prefill_groups_prompts_of_like_length():
    """Admitted prompts are prefilled in groups whose padding stays within PREFILL_PADDING of
    their real tokens (a long prompt does not pad a batch of short ones to its length) and
    whose rows stay within PREFILL_TOKENS."""
    from leapdecode.engine.engine import PREFILL_PAD_ROWS, PREFILL_PADDING, length_groups

    lengths = [400, 40, 380, 48, 200]
    groups = length_groups(lengths)
    assert groups == [[0, 2], [4], [3, 1]]  # [400, 380, 200] would be 1200 rows: over budget
    assert sorted(i for g in groups for i in g) == list(range(len(lengths)))
    for g in groups:
        longest, real = max(lengths[i] for i in g), sum(lengths[i] for i in g)
        assert len(g) * longest - real <= max(PREFILL_PADDING * real, PREFILL_PAD_ROWS)
    assert length_groups([20, 10]) == [[0, 1]]  # a few rows of padding beat a second forward
    assert length_groups([400, 40]) == [[0], [1]]
    assert length_groups([7]) == [[0]] and length_groups([]) == []
    assert length_groups([30] * 16) == [list(range(16))]  # equal prompts: one forward
    assert length_groups([300] * 5) == [[0, 1, 2], [3, 4]]  # at most PREFILL_TOKENS rows
    assert length_groups([2000, 1500]) == [[0], [1]]  # a long prompt alone, whatever it holds


@pytest.mark.parametrize("batches,draft", [((1,), (0.5,)), ((1, 2, 4, 8, 16), (1, 1.2, 1.5, 2.5, 4)),
                                           ((2, 4, 6), (1, 2, 3.5))])  # fmt: skip
def test_the_draft_cost_curve_is_draft_s_at_every_batch_size(batches, draft):
    """auto prices every number of draft rows at once: linear between the profiled batch
    sizes, extrapolated below and past them, and draft_s is the curve at one size."""
    cost = CostModel(batches, (1, 2), [(1.0, 2.0)] * len(batches), draft)
    cost.draft_scale = 1.3

    def expected(b):  # linear between the profiled sizes and past the last; 0 rows cost 0
        if b == 0:
            return 0.0
        if len(batches) == 1:
            return 1.3 * draft[0] * b / batches[0]
        if b >= batches[-1]:
            slope = (draft[-1] - draft[-2]) / (batches[-1] - batches[-2])
            return 1.3 * (draft[-1] + slope * (b - batches[-1]))
        if b <= batches[0]:  # below the first size: the first segment's line
            slope = (draft[1] - draft[0]) / (batches[1] - batches[0])
            return 1.3 * (draft[0] + slope * (b - batches[0]))
        return 1.3 * float(np.interp(b, batches, draft))

    assert cost.draft_curve(0, 24) == pytest.approx([expected(b) for b in range(25)])
    assert cost.draft_curve(3, 9) == pytest.approx([expected(b) for b in range(3, 10)])
    assert [cost.draft_s(b) for b in range(25)] == pytest.approx(cost.draft_curve(0, 24))


def test_auto_alone_scores_every_plan_the_batch_search_does(decoder, prompts):
    """A request alone in the batch (C = 1) is planned one (method, k) at a time in plain
    Python (Planner._auto_alone): under many acceptance estimates and cost models its plan
    is never worse, by the same goodput, than the vectorised search's for that batch."""
    rng = np.random.default_rng(0)
    engine, sched = decoder.engine, decoder.engine.planner
    seq = decoder.request(prompts[0] * 3, method="auto", k=4, max_new_tokens=16)
    engine.add_request(seq)
    engine.step()  # prefill
    seq.tokens.extend(prompts[0][:4])  # the prompt's start again: n-grams match it
    old = sched.cost
    same = 0
    try:
        for trial in range(60):
            step, row = rng.uniform(0.002, 0.02), rng.uniform(0.0, 0.004)
            sched.cost = CostModel((1, 8), (1, 2), ((step, step + row), (4 * step, 4 * step + 8 * row)),
                                   (rng.uniform(0.0005, 0.01), rng.uniform(0.001, 0.02)))  # fmt: skip
            sched.cost.overhead_s = rng.uniform(0.0, 0.003)
            sched.cost.propose["suffix"] = rng.uniform(0.0, 0.001)
            opts = sched._options(seq)
            for _, _, est, _ in opts:  # every method's estimate drawn afresh
                est.rates[1:] = rng.uniform(0.05, 0.98, len(est.rates) - 1)
            fast = sched._auto_alone(seq, opts, sched.cost)
            plan = [None]
            sched._options = lambda s, opts=opts: opts  # the same offers for the batch search
            try:
                sched._auto([seq], plan, [0], alone=False)
            finally:
                del sched._options
            goodput = sched._alone_goodput(seq, opts, sched.cost)

            def score(p, goodput=goodput, opts=opts):
                method, k = p
                if k == 0:
                    return goodput("none", 0, 0.0)
                est, depth = next((e, d) for m, _, e, d in opts if m == method)
                return goodput(method, k, float(est.gains(depth or k)[-1]))

            assert score(fast) >= score(plan[0]) * (1 - 1e-9), (trial, fast, plan[0])
            same += fast == plan[0]
        assert {m for m, _, _, _ in opts} >= {"ngram", "draft"}  # more than one method offered
        assert same >= 40  # mostly the very same plan
    finally:
        sched.cost = old
        engine.abort(seq.id)


def test_packed_steps_price_each_rows_drafts_by_its_own_tokens(decoder, prompts, monkeypatch):
    """Where the target packs rows (`CausalLM.packs_rows`: a chain step costs its real
    tokens, not rows x the longest draft), auto's plan for a batch is within 2% of the best
    of every per-row (method, k) combination by the same goodput, under many acceptance
    estimates and cost models; and a row whose drafts are poor is not drafted to the long
    row's k, as a plan under one cap for every row would."""
    from leapdecode.engine.planner import _Estimate

    rng = np.random.default_rng(3)
    sched = decoder.engine.planner
    seqs = [decoder.request(p, method="auto", k=4, max_new_tokens=32) for p in prompts[:3]]
    monkeypatch.setattr(type(decoder.engine.target), "packs_rows", property(lambda m: 64))
    old, lim = sched.cost, 6
    choices = [("none", 0)] + [(m, k) for m in ("ngram", "suffix") for k in range(1, lim + 1)]
    short = 0
    try:
        for trial in range(25):
            step, row = rng.uniform(0.002, 0.02), rng.uniform(0.0002, 0.004)
            sched.cost = CostModel((1, 8), (1, 2), ((step, step + row), (4 * step, 4 * step + 8 * row)),
                                   (0.001, 0.002))  # fmt: skip
            sched.cost.overhead_s = rng.uniform(0.0, 0.003)
            sched.cost.propose["suffix"] = rng.uniform(0.0, 0.001)
            opts = {}
            for i, s in enumerate(seqs):  # row 0 copies well, the others draw their rates
                rates = [rng.uniform(0.85, 0.99) if i == 0 else rng.uniform(0.05, 0.9)
                         for _ in range(2)]  # fmt: skip
                opts[s.id] = [(m, lim, _Estimate.flat(r), None)
                              for m, r in zip(("ngram", "suffix"), rates, strict=True)]  # fmt: skip
            monkeypatch.setattr(sched, "_options", lambda s, opts=opts: opts[s.id])
            plan = [None] * len(seqs)
            sched._auto(seqs, plan, [0, 1, 2], alone=False)
            verify = sched.cost.verify_curve(3, 3 * (1 + lim), sched._context(seqs))

            def goodput(p, opts=opts, verify=verify):
                tokens, drafts, used = 3.0, 0, set()
                for s, (m, k) in zip(seqs, p, strict=True):
                    if k:
                        est = next(e for name, _, e, _ in opts[s.id] if name == m)
                        tokens += float(est.gains(k)[-1])
                        drafts, used = drafts + k, used | {m}
                cost = sched.cost.overhead_s + verify[3 + drafts]
                return tokens / (cost + sum(sched.cost.propose_s(m) for m in used))

            best = max(goodput(p) for p in itertools.product(choices, repeat=3))
            assert goodput(plan) >= 0.98 * best, (trial, plan)
            short += plan[0][1] > 0 and any(k < plan[0][1] for _, k in plan[1:])
        assert short >= 5  # rows drafted to their own worth, not to one cap
    finally:
        sched.cost = old
