# hybrid_route: kvshare-serve --device hybrid against a fake decoder and a fake provider
# (python3 stand-ins; no model, no NPU). The driver runs every case and prints PASS/FAIL.
add_test(NAME hybrid_route
         COMMAND ${Python3_EXECUTABLE} ${CMAKE_CURRENT_SOURCE_DIR}/hybrid_route.py ${CMAKE_BINARY_DIR}/bin)
set_tests_properties(hybrid_route PROPERTIES TIMEOUT 300)
