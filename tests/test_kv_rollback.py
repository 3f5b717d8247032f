"""After rejected drafts are rolled back, the cache behaves like a fresh prefill."""

import pytest
import torch

from leapdecode.models import load_model


@pytest.mark.parametrize("backend", ["native", "transformers"])
def test_rollback_matches_fresh_prefill(target_dir, backend):
    model = load_model(target_dir, backend=backend)
    torch.manual_seed(0)
    prompt = torch.randint(0, model.vocab_size, (2, 12))
    slots = torch.arange(2)
    model.allocate(2, 64)
    model.forward(prompt, slots)
    kept = [prompt[b].tolist() for b in range(2)]
    # Three verify rounds: feed 5 tokens, keep a different number each time per row.
    for accept in ([2, 5], [0, 3], [4, 1]):
        feed = torch.randint(0, model.vocab_size, (2, 5))
        before = model.lengths(slots)
        model.forward(feed, slots)
        model.truncate(slots, before + torch.tensor(accept))
        for b in range(2):
            kept[b] += feed[b, : accept[b]].tolist()
    probe = torch.randint(0, model.vocab_size, (2, 3))
    got = torch.stack([model.forward(probe[b : b + 1], slots[b : b + 1])[0] for b in range(2)])

    fresh = load_model(target_dir, backend=backend)
    for b in range(2):
        fresh.allocate(1, 64)
        seq = torch.tensor([kept[b] + probe[b].tolist()])
        want = fresh.forward(seq, torch.tensor([0]))[0, -3:]
        assert (got[b] - want).abs().max().item() < 1e-4
