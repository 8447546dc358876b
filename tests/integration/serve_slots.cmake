# serve_slots: kvshare-serve --device hybrid -np 4 with 16 concurrent clients on both
# routes, the patched llama-server as the decoder (LLAMA_SERVER_KVSHARE=path). Exit 77 = skipped.
add_test(NAME llama_server_serve_slots
         COMMAND ${Python3_EXECUTABLE} ${CMAKE_CURRENT_SOURCE_DIR}/serve_slots.py ${CMAKE_BINARY_DIR}/bin)
set_tests_properties(llama_server_serve_slots PROPERTIES TIMEOUT 1200 SKIP_RETURN_CODE 77 LABELS llama_server)

# The shared route's -np 4 cases with the decoder on a Vulkan device (issue #42; lavapipe in
# CI): exit 77 = skipped without one, except under CI=true, where it fails.
add_test(NAME llama_server_serve_slots_vulkan
         COMMAND ${Python3_EXECUTABLE} ${CMAKE_CURRENT_SOURCE_DIR}/serve_slots.py ${CMAKE_BINARY_DIR}/bin --vulkan)
set_tests_properties(llama_server_serve_slots_vulkan PROPERTIES TIMEOUT 1800 SKIP_RETURN_CODE 77 LABELS "llama_server;vulkan")
