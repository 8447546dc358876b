# Helpers shared by every kvshare target. Options are target-scoped, never directory-wide.

# Warnings, sanitizers and the project's include root for one target.
function(kvshare_target_defaults target)
  get_target_property(kind ${target} TYPE)
  if(kind STREQUAL "INTERFACE_LIBRARY")
    return()
  endif()
  target_compile_options(${target} PRIVATE -Wall -Wextra -Wpedantic -Wno-missing-field-initializers)
  if(KVSHARE_SANITIZE)
    target_compile_options(${target} PRIVATE -fsanitize=address,undefined -fno-omit-frame-pointer
                                             -fno-sanitize-recover=undefined)
    target_link_options(${target} PRIVATE -fsanitize=address,undefined)
  endif()
endfunction()

# A kvshare library: sources are every .cc of its folder (and subfolders listed in
# ARGN) so that adding a unit never needs an edit here. Its headers live beside its
# sources; they are internal (only the C API is installed, scripts/cmake/KvshareInstall.cmake).
function(kvshare_library target)
  cmake_parse_arguments(ARG "" "" "LINK_PUBLIC;LINK_PRIVATE;SUBDIRS" ${ARGN})
  set(globs ${CMAKE_CURRENT_SOURCE_DIR}/*.cc)
  foreach(sub IN LISTS ARG_SUBDIRS)
    list(APPEND globs ${CMAKE_CURRENT_SOURCE_DIR}/${sub}/*.cc)
  endforeach()
  file(GLOB sources CONFIGURE_DEPENDS ${globs})
  add_library(${target} ${sources})
  add_library(kvshare::${target} ALIAS ${target})
  target_include_directories(${target} PUBLIC $<BUILD_INTERFACE:${PROJECT_SOURCE_DIR}>)
  target_link_libraries(${target} PUBLIC ${ARG_LINK_PUBLIC} PRIVATE ${ARG_LINK_PRIVATE})
  kvshare_target_defaults(${target})
endfunction()
