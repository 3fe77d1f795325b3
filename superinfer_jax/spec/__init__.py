"""Speculative decoding: proposers guess a request's next tokens on the host, one forward
pass over the paged KV verifies them, and acceptance keeps the output exactly the target
model's (docs/speculative.md)."""
