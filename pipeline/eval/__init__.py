"""`pipeline eval`'s library: real speculative decoding against the live target (block drafting and
DDTree, greedy or sampled), its plain reference, the figures, and the teacher-forced walk on a cache."""
