"""Real speculative decoding against the live target (greedy): block drafting and DDTree."""
