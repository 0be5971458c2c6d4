"""Golden datasets, perplexity and eval gates."""
