"""Tree verification through the engine: tree attention, KV compaction and acceptance.

An oracle proposer knows `transformers`' greedy continuation of every prompt and hides it
among wrong candidates in random trees (often not as the first branch), so accepted paths
run through every kind of branch; the output must still equal `generate` token for token.
"""

import random

import pytest
import torch

import helpers
from helpers import assert_lossless
from leapdecode import LeapDecoder
from leapdecode.proposers.base import Drafts, Proposer
from leapdecode.tree import ancestor_mask, depths

MAX_NEW = 24


class OracleTrees(Proposer):
    name = "ngram"

    def __init__(self, truth: dict[tuple, list[int]], seed: int) -> None:
        self.truth = truth
        self.rng = random.Random(seed)
        self.non_first = 0  # accepted steps whose path left the first branch

    def _tree(self, right: list[int], budget: int, vocab: int) -> tuple[list[int], list[int]]:
        tokens, parents = [], []
        node = 0
        for depth, tok in enumerate(right):
            if len(tokens) >= budget:
                break
            wrong = [(tok + self.rng.randrange(1, vocab)) % vocab
                     for _ in range(self.rng.randrange(0, 3))]  # fmt: skip
            good_right = self.rng.random() < 0.85 or depth == 0
            kids = wrong + ([tok] if good_right else [])
            self.rng.shuffle(kids)
            here = None
            for kid in kids:
                if len(tokens) >= budget:
                    break
                tokens.append(kid)
                parents.append(node)
                if kid == tok and good_right and here is None:
                    here = len(tokens)
            if here is None:
                break
            node = here
        return tokens, parents

    def propose(self, seqs, ks):
        trees = []
        for s, k in zip(seqs, ks, strict=True):
            full = self.truth[tuple(s.tokens[: s.prompt_len])]
            right = full[s.n_out : s.n_out + k]
            trees.append(self._tree(right, k, 384))
        return Drafts.from_trees(trees)


@pytest.fixture(scope="module")
def tree_decoder(target_dir):
    return LeapDecoder.from_pretrained(target_dir, max_num_seqs=8)


@pytest.fixture(scope="module")
def prompts(tree_decoder):
    return helpers.random_prompts(tree_decoder.tokenizer, 24, 3, 50, seed=11)


@pytest.fixture(scope="module")
def reference(prompts, hf_target):
    return helpers.greedy_reference(hf_target, prompts, MAX_NEW)


@pytest.mark.parametrize("k", [3, 8])
def test_oracle_trees_are_lossless_and_take_other_branches(tree_decoder, prompts, reference,
                                                           hf_target, k):  # fmt: skip
    truth = {tuple(p): r for p, r in zip(prompts, reference, strict=True)}
    oracle = OracleTrees(truth, seed=k)
    tree_decoder.engine.proposers["ngram"] = oracle
    results = tree_decoder.generate_batch(prompts, method="ngram", k=k, max_new_tokens=MAX_NEW)
    assert_lossless(prompts, [r.token_ids for r in results], reference, hf_target)
    accepted = sum(r.stats.accepted for r in results)
    steps = sum(r.stats.decode_steps for r in results)
    assert accepted / steps > 1.0, "the oracle's path should be accepted most of the time"


@pytest.fixture(scope="module")
def sliding_dir(tmp_path_factory):
    """A Mistral with a 2-token sliding window: shorter than the tree below is deep."""
    from transformers import MistralConfig, MistralForCausalLM

    torch.manual_seed(5)
    path = str(tmp_path_factory.mktemp("sliding"))
    cfg = MistralConfig(vocab_size=384, hidden_size=64, intermediate_size=128,
                        num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
                        max_position_embeddings=256, sliding_window=2)  # fmt: skip
    MistralForCausalLM(cfg).eval().save_pretrained(path)
    return path


@pytest.mark.parametrize("which", ["llama", "sliding window"])
def test_tree_forward_and_compaction_equal_a_fresh_prefill(target_dir, sliding_dir, which):
    dec = LeapDecoder.from_pretrained(target_dir if which == "llama" else sliding_dir,
                                      max_num_seqs=2)  # fmt: skip
    model = dec.target
    model.allocate(2, 128)
    prompt = [5, 17, 99, 3, 250, 41, 7]
    slots = torch.tensor([0, 1])
    model.forward(torch.tensor([prompt[:-1], prompt[:-1]]), slots)
    # slot 0: tree root -> a -> b, root -> c -> d -> e; slot 1 the same c, d, e as a chain
    a, b, c, d, e, f = 11, 12, 13, 14, 15, 16
    drafts = torch.tensor([[a, b, c, d, e], [c, d, e, 0, 0]])
    parents = torch.tensor([[0, 1, 0, 3, 4], [0, 1, 2, 0, 0]])
    counts = torch.tensor([5, 3])
    mask = ancestor_mask(parents, counts)
    inputs = torch.cat([torch.tensor([[prompt[-1]]] * 2), drafts], dim=1)
    tree_logits = model.forward(inputs, slots, tree_mask=mask, position_offsets=depths(mask))
    # the branch c, d, e scored in the tree equals the chain, and a fresh prefill (e sits 3
    # positions past the root: with a 2-token window it must not see c)
    torch.testing.assert_close(tree_logits[0, [0, 3, 4, 5]], tree_logits[1, [0, 1, 2, 3]])
    model.truncate(slots, torch.zeros(2, dtype=torch.long))
    fresh_cde = model.forward(torch.tensor([prompt + [c, d, e]] * 2), slots)[0, -4:]
    torch.testing.assert_close(tree_logits[0, [0, 3, 4, 5]], fresh_cde, rtol=1e-5, atol=1e-5)
    model.truncate(slots, torch.zeros(2, dtype=torch.long))
    model.forward(torch.tensor([prompt[:-1], prompt[:-1]]), slots)
    model.forward(inputs, slots, tree_mask=mask, position_offsets=depths(mask))
    base = torch.tensor([len(prompt) - 1] * 2)
    model.keep(slots, base, torch.tensor([[0, 3, 4, 5], [0, 1, 2, 3]]), torch.tensor([4, 4]))
    after = model.forward(torch.tensor([[f], [f]]), slots)[:, -1]
    model.truncate(slots, torch.zeros(2, dtype=torch.long))
    fresh = model.forward(torch.tensor([prompt + [c, d, e, f]] * 2), slots)[:, -1]
    torch.testing.assert_close(after, fresh, rtol=1e-5, atol=1e-5)
