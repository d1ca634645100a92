"""Structured outputs: constrained decoding with xgrammar.

    params.py    what a request asks for (guided_json / guided_regex / guided_choice / guided_grammar,
                 structured_outputs, guided_decoding) -> StructuredOutputParams
    compiler.py  StructuredOutputParams -> compiled grammar, cached, on worker threads
    manager.py   per-sample grammar state, the token bitmask of each step, advancing by sampled tokens

The engine talks to this package through StructuredOutputManager (prepare / accept / add / forget);
the runner only calls GrammarBitmask.apply on the logits it is about to sample from.
"""
