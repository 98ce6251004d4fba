"""The FP4 mixture-of-experts family (MXFP4 and NVFP4 experts).

- :mod:`.align`: grouping (token, expert) pairs by expert, on the device;
- :mod:`.triton_moe`: the lesson kernel, portable Triton (notebooks/04_mxfp4_moe_port.ipynb);
- :mod:`.mma_sm90`, :mod:`.gemv_sm90`: the H200's Gluon fast paths (:mod:`.gluon_shared`);
- :mod:`.dispatch`: which runs where, the lesson kernel's tiles, the offline compile cases.
- :mod:`.peer_activation`: our activation fused into OpenAI's triton_kernels MoE (a peer).
"""
