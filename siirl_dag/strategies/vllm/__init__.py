"""vLLM rollout strategy (`rollout.VllmRollout`). Importing the package loads nothing heavy, so
`validate` can read its options without torch or vLLM."""
