"""The E2E harness: a 1-prefill/1-decode MoRIIO READ deployment on two nodes."""
