"""KServe adapter: a kserve.Model predictor with OpenAI-compatible routes, served by kserve.ModelServer."""
