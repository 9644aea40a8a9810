"""The proof: pytest outcomes per run, the revert-red table and its gate,
and the reports they write."""
