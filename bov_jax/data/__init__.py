"""What a run reads: corpora on a disk or in a bucket and the held-out split
(corpus.py), the authors' tokenizer (tokenizer.py), training batches and validation
rows (batches.py), and a run's corpus split and tokenizer found or trained
(sources.py).

Imports: host, store.
"""
