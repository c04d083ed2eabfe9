"""The Triton side of the product, in plain Python: what the model_repository/*/1/model.py adapters call.

    request.py     ensemble input tensors -> a validated GenerateRequest (INVALID_ARG names the field)
    preprocess.py  ernie_tokenizer: chat template / encode, prompt length checks
    engine_model.py ernie_moe: one AsyncEngine per instance, responses per step, cancellation, aborts
    postprocess.py ernie_detokenizer: per-request parser state (sequence numbers, TTL), output tensors
    control.py     the abort channel from the detokenizer back to the engine instance
    metrics.py     ernie:* metric families
    pb.py          pb_utils <-> dict-of-numpy translation shared by the model.py files
    repository.py  render FastDeploy-named flags into a copy of model_repository/
    launcher.py    find/prepare tritonserver, start it, wait until ready, stop it
"""
