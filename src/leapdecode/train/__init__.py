"""Training: corpus, tokenizer, target LM, and a draft distilled from the target."""
