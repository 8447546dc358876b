# hybrid_kvshare_route: the shared route (ONEBIT_KV_SHARE=1) against the fake decoder, which
# sends real memfds over the handshake socket, and the fake provider, which checks what it
# inherited. No model, no dma-buf.
add_test(NAME hybrid_kvshare_route
         COMMAND ${Python3_EXECUTABLE} ${CMAKE_CURRENT_SOURCE_DIR}/hybrid_kvshare_route.py ${CMAKE_BINARY_DIR}/bin)
set_tests_properties(hybrid_kvshare_route PROPERTIES TIMEOUT 300)
