"""Projected taps (issue 68): the drafter reads the taps only through fc (Linear(n*H -> H), no
bias), so a cache may store them projected onto a fixed basis fitted once on a pilot, the drafter
train an fc' on the projection, and the export fold the basis back into an ordinary fc. The basis,
its energy and the fold live in basis.py; basis_file.py keeps it in the cache (basis.safetensors,
beside the manifest); pilot.py reads a cache's first tokens, the pilot a basis is fitted on."""
