"""What a generated package's stages are built on: the stage base class and parameter records
(`api`), building a rank's stages from a package (`package`), frozen parameters (`frozen`) and
the LM head with its loss as one op (`fused_loss`, `torch.ops.ftpipe`, which generated code
calls)."""
