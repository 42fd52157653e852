"""logitserve server: servicer, server lifecycle and CLI (the math lives in logitserve core)."""
