"""The measured search: verify then time candidates on a backend, mutations, SEARCH_LOG, plots."""
