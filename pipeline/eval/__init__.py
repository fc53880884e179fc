"""`pipeline eval`'s library: real speculative decoding against the live target (block drafting and
DDTree, greedy or sampled), its plain reference, the figures, the teacher-forced walk on a cache,
and the drafter a run directory holds with the target its training recorded (drafter_source)."""
