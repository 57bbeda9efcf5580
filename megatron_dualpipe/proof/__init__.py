"""The proof harness: the tiny GPT, its data, the pp=1 reference, the equality check and the
no-hang check, shared by the tests (on the CPU) and ``megatron-dualpipe selftest`` (on the user's
GPUs), so that both prove the same claims through the same code.
"""
