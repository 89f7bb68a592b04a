"""The int4 codec's unpacking on the GPU, shared by the Triton scan kernels (`maxsim_codes`) and the Gluon
stream kernel (`maxsim_int8_hopper_stream`): inline PTX over four bytes of codes in a 32-bit register.

A byte holds value 2m in its low nibble and 2m + 1 in its high one, each a two's-complement nibble; the
two outputs are the four low and the four high nibbles as int8: ((n ^ 8) + 0x78) ^ 0x80 per byte, 7
integer instructions for 8 values where per-element int32 arithmetic takes ~5 each (Hopper issues 64
integer instructions a clock per SM, half its fp32 rate). Constraints "=r,=r,r", pack=4.
"""

INT4_NIBBLES_ASM = (
    "{ .reg .b32 t; "
    "lop3.b32 t, $2, 0x0f0f0f0f, 0x08080808, 0x6a; add.u32 t, t, 0x78787878; xor.b32 $0, t, 0x80808080; "
    "shr.u32 t, $2, 4; "
    "lop3.b32 t, t, 0x0f0f0f0f, 0x08080808, 0x6a; add.u32 t, t, 0x78787878; xor.b32 $1, t, 0x80808080; }"
)
