"""State on disk: stage checkpoints with their manifests (`store`, `files`), saving during a run
(`saver`), and HuggingFace folders written from a run or a checkpoint (`hf`)."""
