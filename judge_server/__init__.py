"""The judge service: rubrics distilled from SME grades, validated against a
golden set, executed by programmatic, transformers or vLLM judges, served over gRPC."""
