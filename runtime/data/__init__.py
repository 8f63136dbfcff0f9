"""Training and evaluation data: opening --data / --eval-data (`sources`), text files and
tokenizers (`text`), pre-tokenized files (`tokens`), and the batches each rank reads
(`batches`)."""
