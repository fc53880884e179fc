"""The tiny-target kit, built by `python -m pipeline.toy.build` into pipeline/embedded/: the tasks
(tasks), the chat template (chat), the tokenizer (tokenizer), the model's architecture (model), its
training (train) and the dataset it regenerates (generate); random_target, a random-weight target
at a real vocabulary size, is for tests and benchmarks."""
