"""Development tools for docs/real-model-on-a-laptop.md: the real model built offline
(build.py), its task (sums.py), the tables and figures of its runs (table.py). train.py, evaluate.py
and the article's modules never import them."""
